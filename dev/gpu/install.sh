#!/usr/bin/env bash
# ON THE DEVICE: install a fully staged engine bundle into its own site dir (offline).
# Usage: bash dev/gpu/install.sh vllm|sglang|ray [--dry-run]
# Joins chunked wheels, checks every sha256, pip-installs with --no-index --no-deps into
# /tmp/<bundle>_site, registers the repo's rlinfer packages there (entry points), and prints the
# environment to use (or: source dev/gpu/env.sh <engine>). `ray` is not an engine: its site
# (/tmp/ray_site, with rlinfer_ray registered) joins either engine's environment once installed.
set -euo pipefail
ENGINE=${1:?usage: install.sh vllm|sglang|ray [--dry-run]}
DRY=${2:-}
STAGE=${GPU_STAGE:-/tmp/gpu_stage}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SITE=${GPU_SITE_ROOT:-/tmp}/${ENGINE}_site
PY=${PYTHON:-python3}
case "$ENGINE" in
  vllm) REGISTER=(rlinfer_core conformance rlinfer_demo rlinfer_server rlinfer_vllm) ;;
  sglang) REGISTER=(rlinfer_core conformance rlinfer_demo rlinfer_server rlinfer_sglang) ;;
  ray) REGISTER=(rlinfer_ray) ;;
  *) echo "install: unknown bundle '$ENGINE' (vllm|sglang|ray)" >&2; exit 2 ;;
esac

if [ -f "$SITE/.installed" ] && [ "$DRY" != "--dry-run" ]; then
  echo "install: $SITE already installed ($(cat "$SITE/.installed"))"
else
  "$PY" "$HERE/bundle_tool.py" assemble --stage "$STAGE" "$ENGINE"
  WHEELS=("$STAGE/$ENGINE"/wheels/*.whl)
  if [ "$DRY" = "--dry-run" ]; then
    echo "install (dry run): would install ${#WHEELS[@]} wheels into $SITE:"
    printf '  %s\n' "${WHEELS[@]##*/}"
    exit 0
  fi
  start=$(date +%s)
  rm -rf "$SITE"
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$SITE" "${WHEELS[@]}"
  "$PY" "$HERE/register_dists.py" --site "$SITE" "${REGISTER[@]}"
  echo "${#WHEELS[@]} wheels, $(( $(date +%s) - start )) s" > "$SITE/.installed"
  echo "install: $ENGINE -> $SITE in $(( $(date +%s) - start )) s ($(du -sm "$SITE" | cut -f1) MiB)"
fi
[ "$ENGINE" = ray ] && { echo "# ray joins the environment of either engine: source dev/gpu/env.sh vllm|sglang"; exit 0; }
echo "# environment for $ENGINE (same as: source dev/gpu/env.sh $ENGINE):"
( source "$HERE/env.sh" "$ENGINE" && env | grep -E '^(PYTHONPATH|LD_LIBRARY_PATH|PATH|PYTHONUNBUFFERED|HF_HUB_OFFLINE|TRANSFORMERS_OFFLINE|TOKENIZERS_PARALLELISM)=' | sed 's/^/export /' )
