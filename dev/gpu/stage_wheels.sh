#!/usr/bin/env bash
# ON THE DEVICE: copy the plain wheels of carried folders (e.g. .gpu/parts/trl, trl-deps1, trl-deps2:
# TRL 1.16 and the closure of datasets it imports, cp312) into ${GPU_STAGE:-/tmp/gpu_stage}/trl,
# across calls (a carry holds at most 64 MiB). Usage: bash dev/gpu/stage_wheels.sh DIR...
set -euo pipefail
dest=${GPU_STAGE:-/tmp/gpu_stage}/trl
mkdir -p "$dest"
for dir in "$@"; do cp "$dir"/*.whl "$dest"/; done
echo "stage_wheels: $(ls "$dest" | wc -l) wheels in $dest"
