# ON THE DEVICE, sourced: environment for running rlinfer on an installed engine bundle.
# Usage: source dev/gpu/env.sh vllm|sglang
# The site dir goes FIRST on PYTHONPATH so the bundle shadows the image where it must
# (SGLang pins transformers 5.12.1, tokenizers, protobuf); then the repo's sources. When the ray
# bundle is installed too (dev/gpu/install.sh ray: ${GPU_SITE_ROOT:-/tmp}/ray_site/.installed),
# its site dir and rlinfer_ray/src follow (after the engine's site, so the engine's pins win).
_gpu_engine=${1:?usage: source dev/gpu/env.sh vllm|sglang}
_gpu_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_gpu_repo=$(cd "$_gpu_here/../.." && pwd)
_gpu_site=${GPU_SITE_ROOT:-/tmp}/${_gpu_engine}_site
case "$_gpu_engine" in
  vllm) _gpu_backend=rlinfer_vllm ;;
  sglang) _gpu_backend=rlinfer_sglang ;;
  *) echo "env.sh: unknown engine '$_gpu_engine'" >&2; return 2 ;;
esac
# the image's own CUDA 13 libraries (torch_memory_saver's preload hook needs them), found
# with a clean PYTHONPATH so the bundle's nvidia/ namespace does not hide the image's
_gpu_cu13=$(PYTHONPATH= python3 -c 'import os, nvidia; print(next((os.path.join(p, "cu13", "lib") for p in nvidia.__path__ if os.path.isdir(os.path.join(p, "cu13", "lib"))), ""))' 2>/dev/null || true)
_gpu_ray=${GPU_SITE_ROOT:-/tmp}/ray_site
_gpu_extra=""
if [ -f "$_gpu_ray/.installed" ]; then
  # Ray's workers (the pool's replicas) inherit this environment through the raylet the driver starts
  _gpu_extra=":$_gpu_ray:$_gpu_repo/rlinfer_ray/src"
  export PATH="$PATH:$_gpu_ray/bin"
fi
export PYTHONPATH="$(python3 "$_gpu_here/bundle_tool.py" pythonpath "$_gpu_site"):$_gpu_repo/rlinfer_core/src:$_gpu_repo/conformance/src:$_gpu_repo/rlinfer_demo/src:$_gpu_repo/rlinfer_server/src:$_gpu_repo/$_gpu_backend/src$_gpu_extra${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$_gpu_cu13" ]; then
  export LD_LIBRARY_PATH="$_gpu_cu13${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PATH="$_gpu_site/bin:$PATH"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the kit's process touches CUDA (IPC packing) before it opens more engines: a forked engine core
# would inherit a CUDA context it cannot use ("CUDA error: initialization error")
export VLLM_WORKER_MULTIPROC_METHOD=spawn
# Never let anything try the hub (there is no network on the device).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset _gpu_engine _gpu_here _gpu_repo _gpu_site _gpu_backend _gpu_cu13 _gpu_ray _gpu_extra
