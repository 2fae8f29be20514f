#!/usr/bin/env bash
# ON THE DEVICE: move carried bundle part(s) into the stage dir, which a warm machine keeps
# between run calls. Usage: bash dev/gpu/stage.sh .gpu/parts/vllm-part01 [more parts...]
# Prints which parts of each engine are still missing (docs/gpu.md has the call sequence).
set -euo pipefail
STAGE=${GPU_STAGE:-/tmp/gpu_stage}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$STAGE"
for part in "$@"; do
  if [ ! -d "$part" ]; then
    echo "stage: no part dir '$part' (did the run call carry it?)" >&2
    exit 2
  fi
  for engine_dir in "$part"/*/; do
    engine=$(basename "$engine_dir")
    mkdir -p "$STAGE/$engine"
    # mv within a file system is instant; across file systems it copies
    find "$engine_dir" -maxdepth 1 -type f -exec mv -f {} "$STAGE/$engine/" \;
  done
  echo "stage: $part -> $STAGE ($(du -sm "$STAGE" | cut -f1) MiB staged in all)"
done
python3 "$HERE/bundle_tool.py" status --stage "$STAGE" || true
