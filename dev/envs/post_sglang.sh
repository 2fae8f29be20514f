#!/usr/bin/env bash
# SGLang CPU fix-ups, run by build_env.sh after dev/envs/sglang-cpu.txt is installed. CPU test
# infrastructure only (see dev/envs/cpu_support/README.md); a GPU install never runs this.
#  1. sglang itself with --no-deps: its metadata pins torch==2.14.1 and CUDA-only packages; the
#     rest of its requirements are in sglang-cpu.txt.
#  2. the `sgl_kernel` CPU shim (an importable stand-in, no kernels).
#  3. the torchvision guard (the registry torchvision is a CUDA build).
# Idempotent: every step can run again on a built env.
set -euo pipefail
: "${VENV:?}" "${ROOT:?}"
py="$VENV/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --no-deps "sglang==0.5.23"
# CUDA-only packages must never sit in this env (e.g. left by an older recipe).
"$py" -m pip uninstall --quiet -y sglang-kernel flashinfer-python torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" --no-deps --force-reinstall "$ROOT/dev/envs/cpu_support/sgl_kernel_cpu_shim"
"$py" "$ROOT/dev/envs/cpu_support/torchvision_guard.py"
# Smoke check: the engine module imports on the CPU path.
SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS=1 "$py" -c "
import torchvision, transformers, sgl_kernel
import sglang
from sglang.srt.entrypoints.engine import Engine
print('sglang', sglang.__version__, 'imports on CPU')
"
