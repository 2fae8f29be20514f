"""What rlinfer's generate costs in the caller's process, against the raw engine call, same engine.

Throughput ratios on a shared machine swing by ±10 % per run (the A/A control of ``rlinfer
bench`` shows it); the CPU time the calling process spends per batch does not. Both sides run the
same batches, alternating (rlinfer first on even batches), after one warm-up each: wall time and
``time.process_time()`` of this process (the facade, the backend's conversion, and the engine's
own client: vLLM's output processing, SGLang's tokenizer manager; the engine's workers run in
other processes) per batch, medians. ``--profile`` adds a cProfile pass per side (top functions
by own time; profiling inflates the CPU times it prints).

    flock /tmp/rlinfer-engine.lock .venvs/sglang/bin/python dev/bench/generate_cpu_cost.py --backend sglang
    # on a GPU (dev/gpu/env.sh): --device cuda --dtype bfloat16 --model /tmp/rlinfer_model \
    #     --prompts 128 --prompt-len 128 --max-tokens 512 --engine-arg attention_backend=triton
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


async def measure(args: argparse.Namespace) -> None:
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_core.types import EngineConfig, parse_assignments
    from rlinfer_demo.bench_sides import make_batch

    model = args.model
    if model is None:
        from rlinfer_core.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "model", seed=0))
    kwargs = parse_assignments(args.engine_arg)
    config = EngineConfig(model=model, seed=0, dtype=args.dtype, device=args.device, engine_kwargs=kwargs)
    engine = await AsyncEngine.open(args.backend, config, load_entry_point_plugins=False)
    try:
        assert engine.model_info is not None
        vocab = engine.model_info.vocab_size
        batches = [
            make_batch(f"b{i}", args.prompts, args.prompt_len, args.max_tokens, vocab, seed=i + 1)
            for i in range(args.batches)
        ]

        async def rlinfer(batch: list[Any]) -> int:
            return sum(len(c.token_ids) for c in await engine.generate(batch))

        sides = {"raw": engine.bench_raw_generate, "rlinfer": rlinfer}
        for side in sides.values():
            await side(batches[0])
        for profiled in (False, True) if args.profile else (False,):
            profiles = {name: cProfile.Profile() for name in sides}
            wall: dict[str, list[float]] = {name: [] for name in sides}
            cpu: dict[str, list[float]] = {name: [] for name in sides}
            for i, batch in enumerate(batches):
                for name in ("rlinfer", "raw") if i % 2 == 0 else ("raw", "rlinfer"):
                    started, cpu_started = time.perf_counter(), time.process_time()
                    if profiled:
                        profiles[name].enable()
                    await sides[name](batch)
                    if profiled:
                        profiles[name].disable()
                    wall[name].append(time.perf_counter() - started)
                    cpu[name].append(time.process_time() - cpu_started)
            for name in sides:
                print(
                    f"{'profiled ' if profiled else ''}{name}: wall {statistics.median(wall[name]) * 1e3:.1f} ms, "
                    f"this process's CPU {statistics.median(cpu[name]) * 1e3:.2f} ms "
                    f"[{min(cpu[name]) * 1e3:.2f}-{max(cpu[name]) * 1e3:.2f}] per batch (median [min-max])"
                )
            if not profiled:
                extra = statistics.median(a - b for a, b in zip(cpu["rlinfer"], cpu["raw"], strict=True))
                share = extra / statistics.median(wall["raw"])
                print(
                    f"rlinfer - raw, this process's CPU per batch: {extra * 1e3:+.2f} ms (paired median) "
                    f"= {share:.2%} of a raw batch's wall time"
                )
            for name in sides if profiled else ():
                text = io.StringIO()
                pstats.Stats(profiles[name], stream=text).sort_stats("tottime").print_stats(args.top)
                print(f"--- {name}, top {args.top} by own time\n{text.getvalue()}")
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", help="HF model dir (default: the tiny random Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="also a cProfile pass per side")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="engine_kwargs entry")
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
