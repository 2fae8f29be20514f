"""``rlinfer bench``: rlinfer's overhead against the raw engine, measured in one run.

Both sides use the *same engine instance* and the *same batch*, alternating A/B runs so that
drift (thermal, cache, other load) hits both equally:

* generate: ``AsyncEngine.generate`` (validation, conversion, version stamping) vs the backend's
  ``rlinfer_bench_raw_generate`` (the engine's native API, no rlinfer types);
* weight update: ``update_weights(CheckpointDir)`` and ``update_weights(NamedTensors)`` (with
  rlinfer's all-or-nothing validation) vs the engine's own reload-from-disk call (plus the
  prefix-cache reset that any correct reload needs, as rlinfer's update does).

Needs a backend claiming ``Capability.BENCH`` (the raw-engine baselines).

Medians of ``--runs`` timed runs after one warm-up of each side.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlinfer_core.engine import AsyncEngine
from rlinfer_core.types import Capability, EngineConfig, GenerateRequest, SamplingParams, parse_assignments
from rlinfer_core.weights import CheckpointDir, NamedTensors


def make_batch(
    tag: str, prompts: int, prompt_len: int, max_tokens: int, vocab: int, seed: int = 0
) -> list[GenerateRequest]:
    """A fixed batch: random prompts, exactly ``max_tokens`` sampled tokens each, with logprobs."""
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, seed=None)
    return [
        GenerateRequest(
            prompt_token_ids=[rng.randrange(16, vocab) for _ in range(prompt_len)],
            sampling=sampling,
            request_id=f"{tag}-{i}",
        )
        for i in range(prompts)
    ]


async def _timed(coro: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = await coro
    return time.perf_counter() - started, result


async def _raw_reload(engine: AsyncEngine, path: str) -> None:
    await engine.bench_raw_weight_update(path)
    if engine.capabilities.supports(Capability.PREFIX_CACHE_RESET):
        await engine.reset_prefix_cache()


def _engine_tensors(engine: AsyncEngine, model_dir: Path) -> list[tuple[str, Any]]:
    """The checkpoint's tensors that the engine accepts, cast to the engine's dtypes."""
    from rlinfer_core.transfer.buckets import to_dtype
    from rlinfer_core.transfer.disk import read_tensors

    specs = engine.weight_specs
    return [(n, t.to(to_dtype(specs[n].dtype))) for n, t in read_tensors(model_dir) if n in specs]


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result."""
    from rlinfer_core.tiny_model import make_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="rlinfer-bench-"))
    model = Path(args.model) if args.model else make_tiny_model(workdir / "model-a", seed=0)
    config = EngineConfig(
        model=str(model),
        seed=0,
        engine_kwargs=parse_assignments(getattr(args, "engine_arg", []) or []),
        **({"dtype": args.dtype} if args.dtype else {}),
    )
    engine = await AsyncEngine.open(args.backend, config, load_entry_point_plugins=False)
    try:
        engine.capabilities.require(Capability.BENCH)
        assert engine.model_info is not None
        vocab = engine.model_info.vocab_size
        runs = max(1, args.runs)
        gen: dict[str, list[float]] = {"rlinfer": [], "raw": []}
        tokens: dict[str, int] = {}
        for run in range(-1, runs):  # run -1 is the warm-up of both sides
            batch = make_batch(f"r{run}", args.prompts, args.prompt_len, args.max_tokens, vocab, seed=run + 1)
            order = ("rlinfer", "raw") if run % 2 == 0 else ("raw", "rlinfer")
            for side in order:
                if side == "rlinfer":
                    seconds, completions = await _timed(engine.generate(batch))
                    count = sum(len(c.token_ids) for c in completions)
                else:
                    seconds, count = await _timed(engine.bench_raw_generate(batch))
                if run >= 0:
                    gen[side].append(count / seconds)
                tokens[side] = count

        # Weight updates: alternate between two checkpoints so every update really changes weights.
        if args.model:
            from rlinfer_core.transfer.disk import save_dir

            second = save_dir(_engine_tensors(engine, model), workdir / "model-b")
        else:
            second = make_tiny_model(workdir / "model-b", seed=1)
        dirs = [model, second]
        tensors = [_engine_tensors(engine, d) for d in dirs]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors[0])
        upd: dict[str, list[float]] = {"rlinfer_disk": [], "rlinfer_tensors": [], "raw_disk": []}
        for run in range(-1, runs):
            which = run % 2
            for side in ("rlinfer_disk", "raw_disk", "rlinfer_tensors"):
                if side == "rlinfer_disk":
                    seconds, _ = await _timed(engine.update_weights(CheckpointDir(str(dirs[which]))))
                elif side == "raw_disk":
                    seconds, _ = await _timed(_raw_reload(engine, str(dirs[which])))
                else:
                    seconds, _ = await _timed(engine.update_weights(NamedTensors(tuple(tensors[which]))))
                if run >= 0:
                    upd[side].append(seconds)
        caps = engine.capabilities
    finally:
        await engine.shutdown()

    med = {k: statistics.median(v) for k, v in gen.items()}
    umed = {k: statistics.median(v) for k, v in upd.items()}
    return {
        "backend": args.backend,
        "engine_version": caps.engine_version,
        "platform": caps.platform,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["rlinfer", *sys.argv[1:]]),
        "model": str(model) if args.model else "tiny random Llama (rlinfer_core.tiny_model, seed 0)",
        "batch": {"prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "runs": runs,
        "generate": {
            "tokens_per_run": tokens,
            "tok_per_s_samples": gen,
            "tok_per_s_median": med,
            "ratio_rlinfer_over_raw": med["rlinfer"] / med["raw"],
            # both sides of a run share its batch and run back to back: robust to slow phases
            "ratio_paired_median": statistics.median(a / b for a, b in zip(gen["rlinfer"], gen["raw"], strict=True)),
        },
        "weight_update": {
            "bytes": nbytes,
            "seconds_samples": upd,
            "seconds_median": umed,
            "ratio_raw_disk_over_rlinfer_disk": umed["raw_disk"] / umed["rlinfer_disk"],
            "ratio_raw_disk_over_rlinfer_tensors": umed["raw_disk"] / umed["rlinfer_tensors"],
        },
    }


def main(args: argparse.Namespace) -> int:
    """Entry of ``rlinfer bench``: print a table and the ratio; write JSON if asked."""
    from rich.console import Console
    from rich.table import Table

    result = asyncio.run(run_bench(args))
    console = Console()
    g, w = result["generate"], result["weight_update"]
    table = Table(title=f"rlinfer bench: {result['backend']} {result['engine_version']} on {result['platform']}")
    table.add_column("measure")
    table.add_column("rlinfer", justify="right")
    table.add_column("raw engine", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row(
        f"generate tok/s (median of {result['runs']})",
        f"{g['tok_per_s_median']['rlinfer']:.0f}",
        f"{g['tok_per_s_median']['raw']:.0f}",
        f"{g['ratio_rlinfer_over_raw']:.3f}",
    )
    table.add_row(
        "weight update from disk, s",
        f"{w['seconds_median']['rlinfer_disk']:.4f}",
        f"{w['seconds_median']['raw_disk']:.4f}",
        f"{w['ratio_raw_disk_over_rlinfer_disk']:.3f}",
    )
    table.add_row(
        "weight update from tensors, s",
        f"{w['seconds_median']['rlinfer_tensors']:.4f}",
        "",
        f"{w['ratio_raw_disk_over_rlinfer_tensors']:.3f}",
    )
    console.print(table)
    print(
        f"generate throughput ratio rlinfer/raw = {g['ratio_rlinfer_over_raw']:.3f} "
        f"(median of per-run ratios {g['ratio_paired_median']:.3f})"
    )
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json_out}")
    return 0
