"""The RL phase switch on one GPU, end to end, through rlinfer's public API.

One cycle, as a colocated GRPO/PPO loop runs it (verl, SkyRL order):

    release_memory()                      # weights + KV cache leave the GPU
    stand-in train step                   # fills the freed memory, a few bf16 matmuls; then freed
    resume_memory(["weights"])
    update_weights(NamedTensors (CUDA))   # the new policy
    resume_memory(["kv_cache"])
    first token                           # one greedy request, max_tokens=1

With ``--discard-weights`` the same cycles run a second time with
``release_memory(discard_weights=True)`` (no host backup of the weights; the full update refills
them), and the table shows both modes; a backend that does not claim ``memory.discard_weights``
gets the reason in the table instead.

Each phase is timed with the GPU synchronised on both sides; medians and spread over
``--cycles`` cycles after one warm-up cycle. ``switch_s`` is the sum of every phase except the
stand-in train step (the time the switch itself costs); ``total_s`` includes it.

    python3 dev/gpu/bench/phase_switch_bench.py --backend vllm --model /tmp/rlinfer_model \
        --json-out $OUT/phase-vllm.json [--discard-weights]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync_bench import GIB, load_weight_sets, memory_snapshot, stats, timed, write_outcome

PHASES = ("release_s", "train_stand_in_s", "resume_weights_s", "update_weights_s", "resume_kv_cache_s", "first_token_s")


def stand_in_train_step(fill_fraction: float) -> dict[str, float]:
    """Allocate ``fill_fraction`` of the free GPU memory and run bf16 matmuls over part of it."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    nbytes = int(free * fill_fraction)
    block = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    side = 4096
    a = block[: side * side].view(side, side).normal_()
    for _ in range(8):
        a = torch.tanh(a @ a.T * (1.0 / side))
    torch.cuda.synchronize()
    del a, block
    torch.cuda.empty_cache()
    return {"filled_gib": nbytes / GIB}


def run_cycles(
    engine: Any, args: argparse.Namespace, first: Any, a: Any, b: Any, *, discard: bool
) -> list[dict[str, float]]:
    """One warm-up cycle and ``args.cycles`` timed ones, alternating weight sets a and b."""
    from rlinfer_core.weights import NamedTensors

    cycles: list[dict[str, float]] = []
    for i in range(args.cycles + 1):
        weights = NamedTensors.of(b if i % 2 == 0 else a)
        cycle: dict[str, float] = {}
        before = memory_snapshot()
        cycle["release_s"], _ = timed(lambda: engine.release_memory(discard_weights=discard))
        cycle["freed_gib"] = memory_snapshot()["free_gib"] - before["free_gib"]
        cycle["train_stand_in_s"], filled = timed(lambda: stand_in_train_step(args.fill))
        cycle["filled_gib"] = filled["filled_gib"]
        cycle["resume_weights_s"], _ = timed(lambda: engine.resume_memory(["weights"]))
        cycle["update_weights_s"], _ = timed(functools.partial(engine.update_weights, weights))
        cycle["resume_kv_cache_s"], _ = timed(lambda: engine.resume_memory(["kv_cache"]))
        cycle["first_token_s"], _ = timed(lambda: engine.generate([first]))
        cycle["switch_s"] = sum(cycle[p] for p in PHASES if p != "train_stand_in_s")
        cycle["total_s"] = cycle["switch_s"] + cycle["train_stand_in_s"]
        if i:  # the first cycle warms allocators and kernels
            cycles.append(cycle)
    return cycles


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up cycle, then ``args.cycles`` timed cycles."""
    import attrs
    import torch

    from rlinfer_core.engine import open_engine
    from rlinfer_core.types import Capability, EngineConfig, GenerateRequest, SamplingParams, parse_assignments

    config = EngineConfig(
        model=str(args.model),
        dtype="bfloat16",
        device="cuda",
        enable_memory_release=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        startup_timeout_s=420.0,
        engine_kwargs=parse_assignments(args.engine_arg),
    )
    result: dict[str, Any] = {
        "bench": "phase_switch_gpu",
        "backend": args.backend,
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": attrs.asdict(config),
        "errors": [],
    }
    engine = open_engine(args.backend, config, load_entry_point_plugins=False)
    result["engine_version"] = engine.capabilities.engine_version
    try:
        vocab = engine.model_info.vocab_size if engine.model_info else 1000
        first = GenerateRequest(
            prompt_token_ids=[(31 * j) % (vocab - 16) + 16 for j in range(64)],
            sampling=SamplingParams(temperature=0.0, max_tokens=1),
        )
        engine.generate([first])
        a, b, nbytes = load_weight_sets(engine, args.model, seed=1)
        result["weights_gb"] = nbytes / 1e9
        result["modes"] = {}
        for mode in ("backup", "discard") if args.discard_weights else ("backup",):
            if mode == "discard" and not engine.capabilities.supports(Capability.MEMORY_DISCARD_WEIGHTS):
                note = engine.capabilities.notes.get(Capability.MEMORY_DISCARD_WEIGHTS.value, "")
                result["modes"][mode] = {"unsupported": note or "not claimed"}
                continue
            cycles = run_cycles(engine, args, first, a, b, discard=mode == "discard")
            keys = [*PHASES, "switch_s", "total_s", "freed_gib", "filled_gib"]
            result["modes"][mode] = {"cycles": cycles, "phases": {k: stats([c[k] for c in cycles]) for k in keys}}
        result["phases"] = result["modes"]["backup"]["phases"]  # the default mode, as before
    except Exception as exc:
        result["errors"].append(f"{type(exc).__name__}: {exc}")
        result["traceback"] = traceback.format_exc()
    finally:
        engine.shutdown()
    return result


def summary(result: dict[str, Any]) -> str:
    """Per-phase medians (ms) of each mode, side by side."""
    modes = result.get("modes")
    if not modes:
        return json.dumps(result, indent=1, default=str)
    names = list(modes)
    rows = [
        f"phase switch, {result['backend']} on {result['gpu']} ({result.get('weights_gb', 0):.2f} GB bf16), "
        "median (min-max):",
        f"  {'phase':<20}" + "".join(f"{name:>30}" for name in names),
    ]
    keys = next((list(m["phases"]) for m in modes.values() if "phases" in m), [])
    for key in keys:
        unit, scale = ("GiB", 1.0) if key.endswith("gib") else ("ms", 1e3)
        cells = []
        for name in names:
            value = modes[name].get("phases", {}).get(key)
            if value is None:
                cells.append(f"{'-':>30}")
                continue
            med, low, high = value["median"] * scale, value["min"] * scale, value["max"] * scale
            cells.append(f"{f'{med:.1f} {unit} ({low:.1f}-{high:.1f})':>30}")
        rows.append(f"  {key:<20}" + "".join(cells))
    for name, mode in modes.items():
        if "unsupported" in mode:
            rows.append(f"  {name}: unsupported by {result['backend']}: {mode['unsupported']}")
    return "\n".join(rows + [f"ERROR {e}" for e in result.get("errors", [])])


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--fill", type=float, default=0.8, help="fraction of free memory the stand-in takes")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--discard-weights",
        action="store_true",
        help="also run the cycles with release_memory(discard_weights=True) and show both modes",
    )
    args = parser.parse_args(argv)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    return write_outcome(args, run, summary, "backend")


if __name__ == "__main__":
    sys.exit(main())
