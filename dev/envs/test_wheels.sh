#!/usr/bin/env bash
# CI check of the packaging: build a wheel and an sdist of every distribution with
# `python -m build`, install the wheels (not editable checkouts) into a fresh venv, and run
# `rlinfer backends --json` from there: both backends must be listed, no plugin may fail to load.
# The engines (vllm, sglang: GB of CUDA wheels) are not installed: the rlinfer wheels go in with
# --no-deps, then their light pure-Python dependencies from the registry.
#   dev/envs/test_wheels.sh            (make test-wheels)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-python3.11}"
out="$root/out/wheels"
tools="$root/.venvs/build-tools"   # build + hatchling, reused between runs
pip_flags=(--quiet --disable-pip-version-check)

dists=()
for d in rlinfer_core rlinfer_vllm rlinfer_sglang conformance rlinfer_demo rlinfer_ray rlinfer_server rlinfer_verl; do
  [[ -f "$root/$d/pyproject.toml" ]] && dists+=("$d")
done

if [[ ! -x "$tools/bin/python" ]] || ! "$tools/bin/python" -c "import build, hatchling" 2>/dev/null; then
  "$python" -m venv "$tools"
  "$tools/bin/python" -m pip install "${pip_flags[@]}" "build>=1.2" "hatchling>=1.25" >/dev/null
fi

rm -rf "$out"
mkdir -p "$out/dist"
for d in "${dists[@]}"; do
  # no isolation: hatchling comes from the tools venv, so no per-build download
  "$tools/bin/python" -m build --no-isolation --sdist --wheel --outdir "$out/dist" "$root/$d" >"$out/build-$d.log" 2>&1 \
    || { cat "$out/build-$d.log"; echo "build of $d failed" >&2; exit 1; }
done
wheels=("$out"/dist/*.whl)
sdists=("$out"/dist/*.tar.gz)
[[ ${#wheels[@]} -eq ${#dists[@]} && ${#sdists[@]} -eq ${#dists[@]} ]] \
  || { ls "$out/dist"; echo "expected one wheel and one sdist per distribution (${dists[*]})" >&2; exit 1; }

"$python" -m venv "$out/venv"
vpip=("$out/venv/bin/python" -m pip install "${pip_flags[@]}" --no-warn-conflicts)
{
  "${vpip[@]}" --no-deps "${wheels[@]}"
  # the light runtime dependencies of rlinfer-core (and of listing backends and commands)
  "${vpip[@]}" "pluggy>=1.5" "attrs>=24.2" "cattrs>=24.1" "packaging>=24" "rich>=13" "pyyaml>=6" "psutil>=5.9"
} >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }

cd "$out"   # away from the checkout: nothing may be imported from the source tree
"$out/venv/bin/rlinfer" backends --json >"$out/backends.json"
"$out/venv/bin/python" - "$out/backends.json" "$out/venv" <<'PY'
import json
import sys

report = json.load(open(sys.argv[1]))
names = {row["name"] for row in report["backends"]}
assert {"vllm", "sglang"} <= names, f"backends listed from the wheels: {sorted(names)}"
assert not report["load_errors"], f"plugins failed to load from the wheels: {report['load_errors']}"
import rlinfer_core

assert rlinfer_core.__file__.startswith(sys.argv[2]), f"rlinfer_core imported from {rlinfer_core.__file__}"
print(f"wheels OK: backends {sorted(names)}; installed from", sys.argv[2])
PY
