#!/usr/bin/env bash
# ON THE DEVICE: install a fully staged engine bundle into its own site dir (offline).
# Usage: bash dev/gpu/install.sh vllm|sglang [--dry-run]
# Joins chunked wheels, checks every sha256, pip-installs with --no-index --no-deps into
# /tmp/<engine>_site, registers the repo's rlinfer packages there (entry points), and prints the
# environment to use (or: source dev/gpu/env.sh <engine>).
set -euo pipefail
ENGINE=${1:?usage: install.sh vllm|sglang [--dry-run]}
DRY=${2:-}
STAGE=${GPU_STAGE:-/tmp/gpu_stage}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SITE=${GPU_SITE_ROOT:-/tmp}/${ENGINE}_site
PY=${PYTHON:-python3}
case "$ENGINE" in
  vllm) BACKEND_PKG=rlinfer_vllm ;;
  sglang) BACKEND_PKG=rlinfer_sglang ;;
  *) echo "install: unknown engine '$ENGINE' (vllm|sglang)" >&2; exit 2 ;;
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
  "$PY" "$HERE/register_dists.py" --site "$SITE" rlinfer_core conformance rlinfer_demo "$BACKEND_PKG"
  echo "${#WHEELS[@]} wheels, $(( $(date +%s) - start )) s" > "$SITE/.installed"
  echo "install: $ENGINE -> $SITE in $(( $(date +%s) - start )) s ($(du -sm "$SITE" | cut -f1) MiB)"
fi
echo "# environment for $ENGINE (same as: source dev/gpu/env.sh $ENGINE):"
( source "$HERE/env.sh" "$ENGINE" && env | grep -E '^(PYTHONPATH|LD_LIBRARY_PATH|PATH|PYTHONUNBUFFERED|HF_HUB_OFFLINE|TRANSFORMERS_OFFLINE|TOKENIZERS_PARALLELISM)=' | sed 's/^/export /' )
