#!/usr/bin/env bash
# ON THE DEVICE (nvidia-h200-x2): the 2-GPU run of issue 12, one short call per step.
# Usage: bash dev/gpu/run_x2.sh STEP...      (docs/gpu.md "The 2-GPU run" has the call sequence)
#   setup    install every fully staged bundle (vllm, sglang, ray; the others are named and
#            skipped), check Ray (dev/gpu/ray_smoke.py: init, actor, a GPU bundle per GPU) and make
#            the model                                                    -> $OUT/setup.txt, ray-smoke.json
#   tp-kit   the conformance kit at tensor_parallel_size=2 for every installed engine AT ONCE
#            (run_suite.sh E tp2; the kits share the GPUs, see run_suite.sh), fault matrix and
#            extra architectures included; for the engines in RLINFER_X2_SPLIT (default: both) as
#            two processes side by side, tp2-main and tp2-faults (the fault matrix alone: ~4 engine
#            starts at TP=2)                          -> $OUT/tp2-{main,faults}-E.{json,log} (8 files)
#   trl-sync TRL's VLLMClient weight sync (NCCL, packed) into `rlinfer serve --dialect vllm` and
#            vLLM's own server (RLINFER_TRL_SERVERS), oracle parity after each update
#                                                            -> $OUT/trl-sync-S.json, .server.log
#   gpu-paths the kit's weight tests with the trainer's tensors on GPU 1 (CUDA IPC asserted) and
#            an NCCL broadcast group from GPU 1 into the engine on GPU 0, for every installed
#            engine side by side (RLINFER_X2_ENGINES); uncaptured (NCCL_DEBUG's lines reach the
#            log) and with every thread's stack after 200 s in one test
#                                                            -> $OUT/conformance-E.{json,log}
#   pool     pool_scaling_bench.py: 2 replicas (one GPU each) vs 1, generate scaling (goal >= 1.9x)
#            and weight sync to 2 vs 1 (goal <= 1.2x), by tensors and disk  -> $OUT/pool-E.{json,log}
# Environment: RLINFER_X2_ENGINES (tp-kit: default every installed engine), RLINFER_X2_SPLIT,
# RLINFER_X2_POOL_ENGINE (default vllm), RLINFER_GPU_TIMEOUT (per step, default 540 s; a run call
# allows 600; the kits: RLINFER_GPU_TIMEOUT_KIT, default 555 s),
# RLINFER_GPU_PYTEST_ARGS / RLINFER_GPU_POOL_ARGS (passed on). At most 8 files go to $OUT.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/rlinfer_out}
export OUT
mkdir -p "$OUT"
SITES=${GPU_SITE_ROOT:-/tmp}
MODEL=${RLINFER_GPU_MODEL:-/tmp/rlinfer_model}
export RLINFER_GPU_TIMEOUT=${RLINFER_GPU_TIMEOUT:-540}
[ $# -gt 0 ] || { echo "usage: run_x2.sh setup|tp-kit|gpu-paths|pool|trl-sync ..." >&2; exit 2; }
rc=0

installed() { [ -f "$SITES/$1_site/.installed" ]; }

engines() {  # the installed engines (or RLINFER_X2_ENGINES)
  if [ -n "${RLINFER_X2_ENGINES:-}" ]; then
    echo "$RLINFER_X2_ENGINES"
    return
  fi
  local e out=""
  for e in vllm sglang; do installed "$e" && out="$out $e"; done
  echo "$out"
}

summary() {  # one line per kit report / pool result
  python3 - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        data = json.load(open(path))
    except (OSError, ValueError) as exc:
        print(f"{path}: no result ({exc})")
        continue
    if data.get("bench") == "pool_scaling":
        fig = data.get("figures", {})
        scale = fig.get("scaling_pool2_over_one_replica_paired", {})
        print(f"{path}: scaling paired median {scale.get('median')} [min {scale.get('min')}] (goal >= 1.9); "
              f"pool2/pool1 {fig.get('scaling_pool2_over_pool1')}; "
              f"sync 2/1 tensors {fig.get('sync_tensors_pool2_over_pool1')} disk {fig.get('sync_disk_pool2_over_pool1')} "
              f"(goal <= 1.2); errors {[e['phase'] + ': ' + e['error'][:200] for e in data.get('errors', [])]}")
        answered = data.get("phases", {}).get("pool2", {}).get("weight_sync", {}).get("replica_answered_s", {})
        for transport, updates in answered.items():  # overlapping loads end together
            per = {i: sorted(float(u[i]) for u in updates if i in u) for i in sorted({k for u in updates for k in u})}
            print(f"  pool2 {transport}: replicas answered after (median s) "
                  + ", ".join(f"r{i} {v[len(v) // 2]:.3f}" for i, v in per.items() if v))
        continue
    failed = [k for k, t in data.get("tests", {}).items() if t.get("outcome") == "failed"]
    print(f"{path}: {data.get('summary')} in {data.get('wall_s')} s, max |dlogprob| "
          f"{data.get('max_abs_logprob_delta')}; failed: {failed}")
PY
}

for s in "$@"; do
  case "$s" in
    setup)
      (
        src=0
        for b in vllm sglang ray; do
          if python3 "$HERE/bundle_tool.py" status --stage "${GPU_STAGE:-/tmp/gpu_stage}" "$b" >/dev/null 2>&1; then
            bash "$HERE/install.sh" "$b" || src=1
          else
            python3 "$HERE/bundle_tool.py" status --stage "${GPU_STAGE:-/tmp/gpu_stage}" "$b"
            echo "setup: $b not (fully) staged, not installed"
          fi
        done
        nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
        df -h /dev/shm /tmp  # Ray's object store lives in /dev/shm (in /tmp, slower, when that is small)
        python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
        for b in vllm sglang ray; do
          installed "$b" && python3 -m pip list --path "$SITES/${b}_site" 2>/dev/null | grep -iE '^(vllm|sglang|sglang-kernel|ray|transformers) '
        done
        first=$(for e in vllm sglang; do installed "$e" && echo "$e" && break; done)
        if installed ray && [ -n "$first" ]; then
          # the smoke test in an engine's environment, as the pool will run
          (source "$HERE/env.sh" "$first" && timeout 180 python3 "$HERE/ray_smoke.py" --json-out "$OUT/ray-smoke.json") || src=1
        fi
        if [ -n "$first" ] && [ ! -f "$MODEL/config.json" ]; then
          (source "$HERE/env.sh" "$first" && timeout 300 python3 "$HERE/make_model.py" "$MODEL") || src=1
        fi
        exit $src
      ) 2>&1 | tee "$OUT/setup.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      ;;
    tp-kit)
      pids=()
      runs=()
      for e in $(engines); do
        if [[ " ${RLINFER_X2_SPLIT-vllm sglang} " == *" $e "* ]]; then
          runs+=("$e tp2-main" "$e tp2-faults")
        else
          runs+=("$e tp2")
        fi
      done
      for r in "${runs[@]}"; do
        # each kit's output goes to its log only ($OUT/<step>-E.log, via run_suite.sh's step)
        # shellcheck disable=SC2086
        RLINFER_GPU_TIMEOUT=${RLINFER_GPU_TIMEOUT_KIT:-555} bash "$HERE/run_suite.sh" $r >/dev/null 2>&1 &
        pids+=($!)
        echo "tp-kit: $r started (pid $!)"
      done
      for p in "${pids[@]}"; do wait "$p" || rc=1; done
      for r in "${runs[@]}"; do
        read -r e st <<< "$r"
        echo "--- $st-$e.log (tail)"
        tail -n 15 "$OUT/$st-$e.log" 2>/dev/null
      done
      summary "$OUT"/tp2*.json
      ;;
    gpu-paths)
      pids=()
      for e in $(engines); do
        RLINFER_GPU_KIT_SELECT="test_update_to_second_model or test_gpu_tensors_reach or test_transports_give_identical" \
          RLINFER_GPU_PYTEST_ARGS="--rlinfer-trainer-device cuda:1 --rlinfer-broadcast-backend nccl --rlinfer-architectures llama -v -s -o faulthandler_timeout=200" \
          bash "$HERE/run_suite.sh" "$e" conformance > /dev/null 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || rc=1; done
      summary "$OUT"/conformance-*.json
      ;;
    pool)
      e=${RLINFER_X2_POOL_ENGINE:-vllm}
      if ! installed ray; then
        echo "pool: the ray bundle is not installed (stage ray-part01, then run_x2.sh setup)" >&2
        rc=1
        continue
      fi
      bash "$HERE/run_suite.sh" "$e" pool > /dev/null 2>&1 || rc=1
      tail -n 30 "$OUT/pool-$e.log" 2>/dev/null
      summary "$OUT/pool-$e.json"
      ;;
    trl-sync)
      # TRL's VLLMClient syncs weights over NCCL, packed, into each vLLM-dialect server of
      # RLINFER_TRL_SERVERS on GPU 0, the trainer on GPU 1. TRL and what its client module imports
      # that the image lacks (datasets and its closure) are wheels staged from .gpu/parts/trl*
      # (dev/gpu/stage_wheels.sh)
      if [ ! -f "$SITES/trl_site/.installed" ]; then
        python3 -m pip install --quiet --no-index --no-deps --target "$SITES/trl_site" "${GPU_STAGE:-/tmp/gpu_stage}"/trl/*.whl \
          && touch "$SITES/trl_site/.installed" || rc=1
      fi
      for server in ${RLINFER_TRL_SERVERS:-rlinfer-vllm vllm-reference}; do
        precision=(--dtype float32 --tol 1e-2)
        [ "$server" = rlinfer-sglang ] && precision=(--dtype bfloat16 --tol 5e-2)  # as the kit runs SGLang on GPU
        (source "$HERE/env.sh" vllm && PYTHONPATH="$PYTHONPATH:$SITES/trl_site" CUDA_VISIBLE_DEVICES=1 \
          timeout "${RLINFER_GPU_TIMEOUT}" python3 "$HERE/trl_weight_sync.py" --server "$server" --model "$MODEL" \
          --out "$OUT/trl-sync-$server.json" "${precision[@]}") 2>&1 | tail -n 25 || rc=1
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      done
      ;;
    *)
      echo "run_x2: unknown step '$s' (setup, tp-kit, gpu-paths, pool, trl-sync)" >&2
      rc=2
      ;;
  esac
done
exit $rc
