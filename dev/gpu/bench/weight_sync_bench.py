"""GPU weight-sync and memory-release benchmark through rlinfer's public API.

For a >= 1 GB bf16 model served by a real engine on one GPU (trainer and engine colocated):

* ``update_weights(NamedTensors)`` with CUDA tensors of this process (the backend ships them by
  CUDA IPC): effective GB/s = bytes of the full state dict / wall time of the call (the facade's
  validation, the transfer, the engine's load and the prefix-cache reset all included); median
  and spread of ``--repeats`` timed updates after one warm-up, alternating two weight sets so
  that every update really changes the weights;
* ``release_memory()`` / ``resume_memory()``: latency, and GPU memory freed, read both by
  ``torch.cuda.mem_get_info`` (device-wide, so it sees the engine's own processes) and by
  ``nvidia-smi``;
* sanity: greedy tokens of a fixed prompt batch before, after the A->B->A round trip and after
  release/resume (on GPU, bf16 kernels are not bit-deterministic, so this is reported, not
  asserted: ``prefix_agreement`` is the mean fraction of leading tokens that agree).

    python3 dev/gpu/bench/weight_sync_bench.py --backend vllm --model /tmp/rlinfer_model \
        --json-out $OUT/weightsync-vllm.json

Writes one JSON document; exits 1 if any stage raised (the error is in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlinfer_core.hookspecs import hookimpl

GB = 1e9
GIB = float(1 << 30)


def nvidia_smi_used_mib() -> float | None:
    """GPU 0's used memory per nvidia-smi (MiB), or None if it cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return float(out.strip().splitlines()[0])
    except Exception:
        return None


def memory_snapshot() -> dict[str, float | None]:
    """Device-wide free/used memory now (GiB), from CUDA and from nvidia-smi."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    smi = nvidia_smi_used_mib()
    return {
        "free_gib": free / GIB,
        "used_gib": (total - free) / GIB,
        "total_gib": total / GIB,
        "nvidia_smi_used_gib": None if smi is None else smi / 1024,
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of fn() with the GPU synchronised on both sides."""
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started, result


def stats(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max of a list of seconds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def prefix_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Mean over samples of the fraction of leading tokens on which two runs agree."""
    fractions = []
    for x, y in zip(a, b, strict=True):
        n = 0
        for p, q in zip(x, y, strict=False):
            if p != q:
                break
            n += 1
        fractions.append(n / max(1, max(len(x), len(y))))
    return sum(fractions) / max(1, len(fractions))


def load_weight_sets(
    engine: Any, model_dir: Path, seed: int, device: str = "cuda"
) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]], int]:
    """Weights A (the checkpoint) and B (A plus small noise) as tensors on ``device``; and their bytes."""
    import torch

    from rlinfer_core.transfer.buckets import to_dtype
    from rlinfer_core.transfer.disk import read_tensors

    specs = engine.weight_specs
    a = [(n, t.to(device=device, dtype=to_dtype(specs[n].dtype))) for n, t in read_tensors(model_dir) if n in specs]
    missing = sorted(set(specs) - {n for n, _ in a})
    if missing:
        raise RuntimeError(f"checkpoint lacks {len(missing)} parameters the engine wants, e.g. {missing[:3]}")
    gen = torch.Generator(device=device).manual_seed(seed)
    b = [(n, t + 1e-3 * torch.randn(t.shape, generator=gen, device=device, dtype=t.dtype)) for n, t in a]
    nbytes = sum(t.numel() * t.element_size() for _, t in a)
    return a, b, nbytes


def breakdown(engine: Any, tensors: list[tuple[str, Any]], nbytes: int, repeats: int) -> dict[str, Any]:
    """Where an update's time goes, by timing its parts alone (medians): the facade's validation
    (all of it, and the names/shapes/dtypes alone, which is what it does for CUDA tensors when the
    backend checks their values on the packed buckets), packing for CUDA IPC into fresh buffers
    (with and without that value check) and into a reused arena's (rlinfer_core.transfer.arena),
    the same packing copy over uint8 views (how packing copied before copies.copy_all), and, as
    the physical floors, one device-to-device copy of the same bytes per tensor (a multi-tensor
    copy) and as one contiguous buffer."""
    import torch

    from rlinfer_core.transfer import ipc
    from rlinfer_core.transfer.arena import PackArena
    from rlinfer_core.transfer.buckets import as_bytes
    from rlinfer_core.transfer.validate import validate_source
    from rlinfer_core.weights import NamedTensors

    source = NamedTensors.of(tensors)
    targets = [torch.empty_like(t) for _, t in tensors]
    byte_slots = [as_bytes(t) for t in targets]
    flat = [torch.empty(nbytes, dtype=torch.uint8, device=tensors[0][1].device) for _ in range(2)]
    arena = PackArena()
    parts: dict[str, Callable[[], Any]] = {
        "validate_s": lambda: validate_source(source, engine.weight_specs),
        "validate_specs_s": lambda: validate_source(source, engine.weight_specs, values=False),
        "pack_for_ipc_s": lambda: ipc.pack_cuda(tensors),
        "pack_checked_s": lambda: ipc.pack_cuda(tensors, check_values=True),
        "pack_into_arena_s": lambda: ipc.pack_cuda(tensors, arena=arena),  # the warm-up allocates
        "copy_as_uint8_s": lambda: torch._foreach_copy_(byte_slots, [as_bytes(t) for _, t in tensors]),
        "d2d_copy_floor_s": lambda: torch._foreach_copy_(targets, [t for _, t in tensors]),
        "d2d_memcpy_floor_s": lambda: flat[1].copy_(flat[0]),
    }
    out: dict[str, Any] = {}
    for name, fn in parts.items():
        fn()  # warm-up
        out[name] = statistics.median(timed(fn)[0] for _ in range(repeats))
    out["d2d_copy_floor_gb_per_s"] = nbytes / GB / out["d2d_copy_floor_s"]
    out["d2d_memcpy_floor_gb_per_s"] = nbytes / GB / out["d2d_memcpy_floor_s"]
    targets.clear()
    byte_slots.clear()
    flat.clear()
    arena.clear()
    torch.cuda.empty_cache()
    return out


class WorkerTimings(logging.Handler):
    """The worker's own timings of each update, read from the backend's debug log line (both
    backends log a dict with ``pack_s`` (the backend's packing), ``map_s``, ``load_s`` in ms and
    ``ipc_reused``: the CUDA-IPC buckets the engine had mapped already (rlinfer_core.transfer.arena);
    vLLM's also ``fast_load``: 1.0 where one batched copy loaded the update, see
    rlinfer_vllm.worker.fast_load). Nothing is collected for backends without such a line."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.rows: list[dict[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the dict argument of a record that carries worker timings."""
        args = record.args if isinstance(record.args, tuple) else ()
        self.rows.extend(dict(a) for a in args if isinstance(a, dict) and "load_s" in a)

    def summary(self) -> dict[str, Any]:
        """Medians in ms of the rows' timing keys, and how many updates were loaded fast."""
        if not self.rows:
            return {}
        keys = sorted({k for row in self.rows for k in row if k.endswith("_s")})
        out: dict[str, Any] = {
            f"{k.removesuffix('_s')}_ms": statistics.median(r[k] for r in self.rows if k in r) for k in keys
        }
        out["fast_load_updates"] = sum(1 for r in self.rows if r.get("fast_load") == 1.0)
        # FP8 engines: updates quantized by the worker itself (rlinfer_vllm.worker.fp8_load), no reload
        out["fast_fp8_updates"] = sum(1 for r in self.rows if r.get("fast_fp8") == 1.0)
        # per update, in order: 0 on the first update of a layout, every bucket after it
        out["ipc_reused_buckets"] = [r.get("ipc_reused") for r in self.rows]
        out["updates"] = len(self.rows)
        return out


class UpdateTimes:
    """rlinfer event plugin: each weight update's seconds after validation (the facade's event)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    @hookimpl
    def rlinfer_on_weights_updated(self, seconds: float) -> None:
        """Record the backend's seconds (pluggy passes only the arguments named here)."""
        self.seconds.append(seconds)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; stages that fail are recorded and the rest still run if possible."""
    import attrs
    import torch

    from rlinfer_core import engine as rl_engine
    from rlinfer_core.types import Capability, EngineConfig, GenerateRequest, SamplingParams, parse_assignments
    from rlinfer_core.weights import NamedTensors

    if not torch.cuda.is_available():
        raise SystemExit("weight_sync_bench: needs a CUDA GPU")
    result: dict[str, Any] = {
        "bench": "weight_sync_gpu",
        "backend": args.backend,
        "model": str(args.model),
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "errors": [],
    }
    memory: dict[str, Any] = {"before_start": memory_snapshot()}
    config = EngineConfig(
        model=str(args.model),
        dtype="bfloat16",
        device="cuda",
        seed=0,
        enable_memory_release=True,
        enforce_eager=args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        verify_updates=args.verify_updates,
        engine_kwargs=parse_assignments(args.engine_arg),
    )
    result["config"] = attrs.asdict(config)
    update_times = UpdateTimes()
    worker_timings = WorkerTimings()
    logging.getLogger(f"rlinfer_{args.backend}").addHandler(worker_timings)
    result["fast_load_env"] = os.environ.get(f"RLINFER_{args.backend.upper()}_FAST_LOAD")  # "0": the A/B baseline
    result["reuse_ipc_env"] = os.environ.get("RLINFER_REUSE_IPC_BUFFERS")  # "0": packed fresh, mapped each time
    start_s, engine = timed(
        lambda: rl_engine.open_engine(args.backend, config, load_entry_point_plugins=False, plugins=[update_times])
    )
    result["engine_start_s"] = start_s
    result["engine_version"] = engine.capabilities.engine_version
    memory["after_start"] = memory_snapshot()
    try:
        assert engine.model_info is not None
        vocab = engine.model_info.vocab_size
        greedy = SamplingParams(temperature=0.0, max_tokens=args.check_tokens, ignore_eos=True)
        prompts = [
            GenerateRequest(
                prompt_token_ids=[(97 * i + 31 * j) % (vocab - 16) + 16 for j in range(32)], sampling=greedy
            )
            for i in range(8)
        ]

        def tokens() -> list[tuple[int, ...]]:
            return [c.token_ids for c in engine.generate(prompts)]

        base = tokens()
        a, b, nbytes = load_weight_sets(engine, args.model, seed=1)
        result["weights"] = {"tensors": len(a), "bytes": nbytes, "gb": nbytes / GB}
        if nbytes < 1e9:
            result["errors"].append(f"model has only {nbytes / GB:.2f} GB of weights; the brief asks for >= 1 GB")

        # --- weight sync: warm-up, then alternate B, A, B, ... --------------------------------
        update: dict[str, Any] = {"transport": "NamedTensors (CUDA tensors, colocated)", "seconds": []}
        try:
            warm_s, _ = timed(lambda: engine.update_weights(NamedTensors.of(b)))
            update["warmup_s"] = warm_s
            after_b = tokens()
            seconds: list[float] = []
            update_times.seconds.clear()
            worker_timings.rows.clear()
            sets = [a, b]
            for i in range(args.repeats):
                source = NamedTensors.of(sets[i % 2])
                s, _ = timed(functools.partial(engine.update_weights, source))
                seconds.append(s)
            if args.repeats % 2 == 0:  # make sure A is what is served at the end
                s, _ = timed(lambda: engine.update_weights(NamedTensors.of(a)))
                seconds.append(s)
            update["seconds"] = seconds
            update["time_s"] = stats(seconds)
            update["gb_per_s"] = {
                "median": nbytes / GB / statistics.median(seconds),
                "best": nbytes / GB / min(seconds),
                "worst": nbytes / GB / max(seconds),
            }
            update["weight_version"] = engine.weight_version
            update["breakdown"] = breakdown(engine, a, nbytes, args.repeats)
            # the facade's event: everything after validation (pack, transfer, load, prefix reset)
            update["breakdown"]["backend_s"] = statistics.median(update_times.seconds)
            # inside the worker: mapping the handles (map_ms), checks + load (load_ms), fast path
            update["breakdown"]["worker"] = worker_timings.summary()
            after_a = tokens()
            if engine.capabilities.supports(Capability.WEIGHTS_CHECKSUM):
                # the served weights against A, bit for bit, computed inside the engine
                check = engine.verify_weights(a)
                update["verify_after_round_trip"] = {"ok": check.ok, "mismatched": list(check.mismatched)[:10]}
                # what a verified update adds: the engine's readback and the trainer's digests
                update["verify_weights_s"] = stats([timed(lambda: engine.verify_weights(a))[0] for _ in range(3)])
            update["verify_updates"] = engine.verifies_updates
            update["sanity"] = {
                "b_differs_from_a_prefix_agreement": prefix_agreement(base, after_b),
                "round_trip_prefix_agreement": prefix_agreement(base, after_a),
            }
        except Exception as exc:
            result["errors"].append(f"update_weights: {type(exc).__name__}: {exc}")
            update["traceback"] = traceback.format_exc()
        result["update_weights"] = update

        # --- release / resume -------------------------------------------------------------------
        mem: dict[str, Any] = {"release_s": [], "resume_s": [], "freed_gib": [], "freed_smi_gib": []}
        try:
            for _ in range(args.memory_repeats):
                before = memory_snapshot()
                rel_s, _ = timed(lambda: engine.release_memory())
                released = memory_snapshot()
                res_s, _ = timed(lambda: engine.resume_memory())
                resumed = memory_snapshot()
                mem["release_s"].append(rel_s)
                mem["resume_s"].append(res_s)
                mem["freed_gib"].append(released["free_gib"] - before["free_gib"])  # type: ignore[operator]
                if before["nvidia_smi_used_gib"] is not None and released["nvidia_smi_used_gib"] is not None:
                    mem["freed_smi_gib"].append(before["nvidia_smi_used_gib"] - released["nvidia_smi_used_gib"])
                mem.setdefault("snapshots", []).append({"before": before, "released": released, "resumed": resumed})
            mem["release_time_s"] = stats(mem["release_s"])
            mem["resume_time_s"] = stats(mem["resume_s"])
            engine_gib = memory["after_start"]["used_gib"] - memory["before_start"]["used_gib"]
            mem["engine_footprint_gib"] = engine_gib
            mem["freed_fraction"] = statistics.median(mem["freed_gib"]) / engine_gib
            # the RL order (verl, SkyRL): wake the weights, sync new ones, then wake the KV cache
            split: dict[str, list[float]] = {"resume_weights_s": [], "resume_kv_cache_s": []}
            for _ in range(args.memory_repeats):
                engine.release_memory()
                split["resume_weights_s"].append(timed(lambda: engine.resume_memory(["weights"]))[0])
                split["resume_kv_cache_s"].append(timed(lambda: engine.resume_memory(["kv_cache"]))[0])
            mem["split_resume"] = {k: stats(v) for k, v in split.items()}
            after_resume = tokens()
            mem["sanity_prefix_agreement_after_resume"] = prefix_agreement(base, after_resume)
        except Exception as exc:
            result["errors"].append(f"release/resume: {type(exc).__name__}: {exc}")
            mem["traceback"] = traceback.format_exc()
        result["memory_release"] = mem
        result["memory"] = memory
    finally:
        t, _ = timed(engine.shutdown)
        result["shutdown_s"] = t
    return result


def summary(result: dict[str, Any]) -> str:
    """A short table for the end of the log."""
    lines = [f"backend {result['backend']} on {result.get('gpu')}: start {result.get('engine_start_s', 0):.1f} s"]
    w = result.get("weights", {})
    u = result.get("update_weights", {})
    if "gb_per_s" in u:
        lines.append(
            f"update_weights(NamedTensors, CUDA): {w['gb']:.2f} GB in {u['time_s']['median']:.3f} s median "
            f"-> {u['gb_per_s']['median']:.1f} GB/s (best {u['gb_per_s']['best']:.1f}); "
            f"round-trip agreement {u['sanity']['round_trip_prefix_agreement']:.2f}"
        )
    m = result.get("memory_release", {})
    if "release_time_s" in m:
        lines.append(
            f"release {m['release_time_s']['median']:.3f} s freed {statistics.median(m['freed_gib']):.1f} GiB "
            f"(nvidia-smi {statistics.median(m['freed_smi_gib']) if m['freed_smi_gib'] else float('nan'):.1f}); "
            f"resume {m['resume_time_s']['median']:.3f} s; freed {m['freed_fraction']:.0%} of the engine's "
            f"{m['engine_footprint_gib']:.1f} GiB"
        )
    if "split_resume" in m:
        sr = m["split_resume"]
        lines.append(
            f"resume weights {sr['resume_weights_s']['median']:.3f} s, then KV cache "
            f"{sr['resume_kv_cache_s']['median']:.3f} s"
        )
    if "breakdown" in u:
        b = u["breakdown"]
        lines.append(
            f"parts: validate {b['validate_s'] * 1e3:.1f} ms (specs only {b['validate_specs_s'] * 1e3:.1f} ms), "
            f"pack for IPC {b['pack_for_ipc_s'] * 1e3:.1f} ms (value check incl. {b['pack_checked_s'] * 1e3:.1f} ms) "
            f"(into a reused arena {b['pack_into_arena_s'] * 1e3:.1f} ms), "
            f"backend + prefix reset {b['backend_s'] * 1e3:.1f} ms, "
            f"d2d copy floor {b['d2d_copy_floor_s'] * 1e3:.2f} ms ({b['d2d_copy_floor_gb_per_s']:.0f} GB/s)"
        )
        worker = b.get("worker") or {}
        if "load_ms" in worker:
            lines.append(
                f"backend pack {worker.get('pack_ms', float('nan')):.2f} ms, "
                f"worker: map {worker.get('map_ms', float('nan')):.2f} ms, load {worker['load_ms']:.2f} ms "
                f"(fast load on {worker['fast_load_updates']}/{worker['updates']} updates; "
                f"RLINFER_{str(result.get('backend')).upper()}_FAST_LOAD={result.get('fast_load_env')}; "
                f"buckets mapped before, per update: {worker['ipc_reused_buckets']}; "
                f"RLINFER_REUSE_IPC_BUFFERS={result.get('reuse_ipc_env')})"
            )
    lines += [f"ERROR {e}" for e in result.get("errors", [])]
    return "\n".join(lines)


def write_outcome(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    summary: Callable[[dict[str, Any]], str],
    done_key: str,
) -> int:
    """Run a bench, write its JSON (or the error and traceback) to ``args.json_out`` and print the
    summary (the raw JSON when ``done_key`` is missing); exit status 1 on errors."""
    try:
        result = run(args)
    except Exception as exc:
        result = {
            "backend": args.backend,
            "errors": [f"{type(exc).__name__}: {exc}"],
            "traceback": traceback.format_exc(),
        }
    args.json_out.write_text(json.dumps(result, indent=1, default=str))
    print(summary(result) if done_key in result else json.dumps(result, indent=1))
    return 1 if result.get("errors") else 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", type=Path, required=True, help="HF model dir (>= 1 GB of bf16 weights)")
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5, help="timed weight updates (median reported)")
    parser.add_argument("--memory-repeats", type=int, default=3, help="release/resume cycles")
    parser.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per sanity prompt")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="allow CUDA graphs / torch.compile")
    parser.add_argument(
        "--no-verify-updates",
        dest="verify_updates",
        action="store_false",
        help="EngineConfig.verify_updates=False (the A/B baseline of the verified update's cost)",
    )
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="engine_kwargs entry")
    args = parser.parse_args(argv)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger(f"rlinfer_{args.backend}").setLevel(logging.DEBUG)  # per-update timings
    return write_outcome(args, run, summary, "gpu")


if __name__ == "__main__":
    sys.exit(main())
