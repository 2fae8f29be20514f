#!/usr/bin/env bash
# ON THE DEVICE: run rlinfer's GPU checks against an installed engine bundle (dev/gpu/install.sh).
# Usage: bash dev/gpu/run_suite.sh vllm|sglang [STEP...]
#   STEPs (default: all, in this order): info model conformance bench weightsync
#   - info:        nvidia-smi, versions, `rlinfer backends --json`             -> $OUT/info-E.txt
#   - model:       the ~0.6B random bf16 model in $RLINFER_GPU_MODEL (kept while warm)
#   - conformance: the conformance kit                                         -> $OUT/conformance-E.{json,log}
#   - bench:       `rlinfer bench` (rlinfer vs raw engine) on that model        -> $OUT/bench-E.{json,log}
#   - weightsync:  dev/gpu/bench/weight_sync_bench.py (CUDA-IPC GB/s, release/resume) -> $OUT/weightsync-E.{json,log}
#   - weightsync-noverify: the same with EngineConfig.verify_updates=False (the verified update's
#                  A/B baseline)                                                -> $OUT/weightsync-noverify-E.{json,log}
#   - bench-det:   `rlinfer bench` on a deterministic engine (EngineConfig.deterministic) -> $OUT/bench-det-E.{json,log}
#   - bench-server: `rlinfer bench` in server mode vs an in-process twin       -> $OUT/bench-server-E.{json,log}
#   - phase:       dev/gpu/bench/phase_switch_bench.py (release -> train -> resume -> update -> first token)
#                                                                                -> $OUT/phase-E.{json,log}
#   - stall:       dev/gpu/bench/stall_bench.py (128 streaming requests; the longest inter-token gap
#                  a weight update causes, and tokens/s while it runs, vs undisturbed phases; extra
#                  args: RLINFER_GPU_STALL_ARGS, e.g. "--clock engine": vLLM's own step stamps)
#                                                                               -> $OUT/stall-E.{json,log}
#   - fp8:         dev/gpu/bench/fp8_refit_bench.py (FP8 rollout from BF16 weights: refit time FP8/BF16,
#                  |dlogprob| vs the BF16 engine and an HF oracle, updates served) -> $OUT/fp8-E.{json,log}
#   Two-GPU steps (nvidia-h200-x2; dev/gpu/run_x2.sh drives them, docs/gpu.md "The 2-GPU run"):
#   - tp2:         the conformance kit at tensor_parallel_size=2 (every engine it opens: the main
#                  one, the extra architectures', the fault matrix's), verbose  -> $OUT/tp2-E.{json,log}
#   - tp2-main, tp2-faults: the same kit without / with only the fault matrix (two processes that
#                  can run side by side)                   -> $OUT/tp2-main-E.{json,log}, tp2-faults-E.{json,log}
#   - pool:        dev/gpu/bench/pool_scaling_bench.py, 2 replicas (one GPU each) vs 1 (needs the
#                  ray bundle: dev/gpu/install.sh ray)                          -> $OUT/pool-E.{json,log}
#   - ray:         dev/gpu/ray_smoke.py (ray.init, an actor, one GPU bundle per GPU) -> $OUT/ray-E.json
# A run call is limited to 600 s and an engine start takes ~1.5 min on the GPU, so pass one or
# two steps per call (docs/gpu.md has the sequence). Per-step time limits: RLINFER_GPU_TIMEOUT
# (seconds, default 540). Extra args: RLINFER_GPU_PYTEST_ARGS (kit), RLINFER_GPU_BENCH_ARGS
# (rlinfer bench), RLINFER_GPU_WEIGHTSYNC_ARGS, RLINFER_GPU_POOL_ARGS, RLINFER_GPU_FP8_ARGS; they come after the GPU
# defaults below, so they win.
# Writes at most 8 files to $OUT (what a run call can bring back).
#
# GPU defaults: the kit runs with memory release on and a logprob tolerance of 2e-3 (its CPU
# default, 1e-5, is float32-on-CPU exact; float32 on GPU kernels measured 1.3e-4 - 5.3e-4).
# SGLang gets attention_backend=triton everywhere (the lean bundle prunes FlashAttention 3), and
# its kit runs in bfloat16 (sgl_kernel's RMSNorm has no float32) at a tolerance of 3e-2 (bfloat16
# vs the float32 oracle on the kit's model: 8e-3 on CPU).
set -uo pipefail
ENGINE=${1:?usage: run_suite.sh vllm|sglang [info model conformance bench weightsync]}
shift
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(info model conformance bench weightsync)
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/rlinfer_out}
mkdir -p "$OUT"
MODEL=${RLINFER_GPU_MODEL:-/tmp/rlinfer_model}
LIMIT=${RLINFER_GPU_TIMEOUT:-540}
SITE=${GPU_SITE_ROOT:-/tmp}/${ENGINE}_site
if [ ! -f "$SITE/.installed" ]; then
  echo "run_suite: $SITE is not installed; stage the parts and run dev/gpu/install.sh $ENGINE first" >&2
  exit 2
fi
# shellcheck source=/dev/null
source "$HERE/env.sh" "$ENGINE"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
rc=0
# The kit opens several engines at once (the main one, one per extra architecture, the fault
# matrix's): each takes a quarter of the GPU at most, and eager mode keeps their starts short.
KIT_ARGS=(--rlinfer-config enable_memory_release=true --rlinfer-logprob-tol 2e-3
  --rlinfer-config gpu_memory_utilization=0.2 --rlinfer-config enforce_eager=true)
ENGINE_ARGS=()
if [ "$ENGINE" = sglang ]; then
  KIT_ARGS+=(--rlinfer-engine-arg attention_backend=triton --rlinfer-config dtype=bfloat16 --rlinfer-logprob-tol 3e-2)
  ENGINE_ARGS+=(--engine-arg attention_backend=triton)
fi

step() {  # step NAME LOGFILE CMD...: run with a time limit, log to $OUT, remember failures
  local name=$1 log=$2
  shift 2
  echo "=== [$ENGINE] $name: $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=20 "$LIMIT" "$@" 2>&1 | tee "$log"
  local s=${PIPESTATUS[0]}
  echo "=== [$ENGINE] $name: exit $s after $(( SECONDS - t0 )) s" | tee -a "$log"
  [ "$s" -eq 0 ] || rc=1
}

for s in "${STEPS[@]}"; do
  case "$s" in
    info)
      {
        nvidia-smi
        python3 -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
        python3 -m pip list --path "$SITE" 2>/dev/null | grep -iE '^(vllm|sglang|sglang-kernel|flashinfer|transformers|tokenizers|xgrammar|torch-memory-saver) '
        python3 -c 'import transformers; print("transformers in use:", transformers.__version__, transformers.__file__)'
        rlinfer backends --json
      } > "$OUT/info-$ENGINE.txt" 2>&1
      cat "$OUT/info-$ENGINE.txt"
      ;;
    model)
      python3 "$HERE/make_model.py" "$MODEL" || rc=1
      ;;
    conformance)
      # RLINFER_GPU_KIT_SELECT: a pytest -k expression (a subset of the kit)
      select=()
      [ -n "${RLINFER_GPU_KIT_SELECT:-}" ] && select=(-k "$RLINFER_GPU_KIT_SELECT")
      # shellcheck disable=SC2086
      step conformance "$OUT/conformance-$ENGINE.log" python3 -m pytest \
        "tests/backends/test_${ENGINE}_conformance.py" -q -p rlinfer_conformance \
        --rlinfer-backend "$ENGINE" --rlinfer-report "$OUT/conformance-$ENGINE.json" "${select[@]}" \
        "${KIT_ARGS[@]}" ${RLINFER_GPU_PYTEST_ARGS:-}
      ;;
    bench)
      # shellcheck disable=SC2086
      step bench "$OUT/bench-$ENGINE.log" rlinfer bench --backend "$ENGINE" --model "$MODEL" \
        --dtype bfloat16 --prompts 128 --prompt-len 128 --max-tokens 512 --runs 9 \
        --json-out "$OUT/bench-$ENGINE.json" "${ENGINE_ARGS[@]}" ${RLINFER_GPU_BENCH_ARGS:-}
      ;;
    bench-det)
      # the throughput cost of EngineConfig(deterministic=True): rlinfer vs raw on a deterministic
      # engine, compared with the plain bench's tok/s (same batch, separate engine starts)
      # shellcheck disable=SC2086
      step bench-det "$OUT/bench-det-$ENGINE.log" rlinfer bench --backend "$ENGINE" --model "$MODEL" \
        --dtype bfloat16 --prompts 128 --prompt-len 128 --max-tokens 512 --runs 3 --set deterministic=true \
        --json-out "$OUT/bench-det-$ENGINE.json" "${ENGINE_ARGS[@]}" ${RLINFER_GPU_BENCH_ARGS:-}
      ;;
    bench-server)
      # server mode (the engine's real HTTP server as a child) against an in-process twin of the
      # same config, both on this GPU (0.4 of its memory each)
      # shellcheck disable=SC2086
      step bench-server "$OUT/bench-server-$ENGINE.log" rlinfer bench --backend "$ENGINE" --model "$MODEL" \
        --dtype bfloat16 --prompts 128 --prompt-len 128 --max-tokens 512 --runs 5 --set mode=server \
        --set gpu_memory_utilization=0.4 --set startup_timeout_s=400 \
        --json-out "$OUT/bench-server-$ENGINE.json" "${ENGINE_ARGS[@]}" ${RLINFER_GPU_BENCH_ARGS:-}
      ;;
    weightsync-noverify)
      step weightsync-noverify "$OUT/weightsync-noverify-$ENGINE.log" python3 dev/gpu/bench/weight_sync_bench.py \
        --backend "$ENGINE" --model "$MODEL" --json-out "$OUT/weightsync-noverify-$ENGINE.json" \
        --no-verify-updates "${ENGINE_ARGS[@]}" ${RLINFER_GPU_WEIGHTSYNC_ARGS:-}
      ;;
    weightsync)
      step weightsync "$OUT/weightsync-$ENGINE.log" python3 dev/gpu/bench/weight_sync_bench.py \
        --backend "$ENGINE" --model "$MODEL" --json-out "$OUT/weightsync-$ENGINE.json" \
        "${ENGINE_ARGS[@]}" ${RLINFER_GPU_WEIGHTSYNC_ARGS:-}
      ;;
    tp2 | tp2-main | tp2-faults)
      # same GPU defaults as the kit on one GPU: gpu_memory_utilization=0.2 per rank (the kit holds
      # up to 3 engines at once: main + an extra architecture's or a fault-matrix engine; with
      # kv_cache_memory_bytes fixed by the kit, each really uses a few GB per GPU, so kits can
      # share the two GPUs), eager mode for short starts; a --basetemp of its own so that kits
      # running at once never share or clean up each other's temp dirs. tp2-main leaves out the
      # fault matrix (4 engine starts at TP=2), tp2-faults runs only it: run side by side, they
      # halve the wall time of the kit
      select=()
      [ "$s" = tp2-main ] && select=(-k "not test_each_engine_process_killed_in_turn")
      [ "$s" = tp2-faults ] && select=(-k "test_each_engine_process_killed_in_turn")
      # shellcheck disable=SC2086
      step "$s" "$OUT/$s-$ENGINE.log" python3 -m pytest \
        "tests/backends/test_${ENGINE}_conformance.py" -v -p rlinfer_conformance \
        --rlinfer-backend "$ENGINE" --rlinfer-report "$OUT/$s-$ENGINE.json" "${select[@]}" \
        "${KIT_ARGS[@]}" --rlinfer-config tensor_parallel_size=2 --rlinfer-config startup_timeout_s=300 \
        --durations=12 --basetemp "/tmp/rlinfer-kit-$s-$ENGINE" ${RLINFER_GPU_PYTEST_ARGS:-}
      ;;
    pool)
      # shellcheck disable=SC2086
      step pool "$OUT/pool-$ENGINE.log" python3 dev/gpu/bench/pool_scaling_bench.py \
        --backend "$ENGINE" --model "$MODEL" --replicas 2 --phases pool2,pool1 \
        --json-out "$OUT/pool-$ENGINE.json" "${ENGINE_ARGS[@]}" ${RLINFER_GPU_POOL_ARGS:-}
      ;;
    ray)
      python3 "$HERE/ray_smoke.py" --json-out "$OUT/ray-$ENGINE.json" || rc=1
      ;;
    phase)
      # shellcheck disable=SC2086
      step phase "$OUT/phase-$ENGINE.log" python3 dev/gpu/bench/phase_switch_bench.py \
        --backend "$ENGINE" --model "$MODEL" --json-out "$OUT/phase-$ENGINE.json" "${ENGINE_ARGS[@]}" \
        ${RLINFER_GPU_PHASE_ARGS:-}
      ;;
    fp8)
      # shellcheck disable=SC2086
      step fp8 "$OUT/fp8-$ENGINE.log" python3 dev/gpu/bench/fp8_refit_bench.py \
        --backend "$ENGINE" --model "$MODEL" --json-out "$OUT/fp8-$ENGINE.json" "${ENGINE_ARGS[@]}" \
        ${RLINFER_GPU_FP8_ARGS:-}
      ;;
    stall)
      # shellcheck disable=SC2086
      step stall "$OUT/stall-$ENGINE.log" python3 dev/gpu/bench/stall_bench.py \
        --backend "$ENGINE" --model "$MODEL" --json-out "$OUT/stall-$ENGINE.json" "${ENGINE_ARGS[@]}" \
        ${RLINFER_GPU_STALL_ARGS:-}
      ;;
    *)
      echo "run_suite: unknown step '$s'" >&2
      rc=2
      ;;
  esac
done
exit $rc
