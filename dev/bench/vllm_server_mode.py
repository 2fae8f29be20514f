"""Generate throughput of the vLLM backend in server mode vs in-process (CPU or GPU).

Both engines are open at once on the same model and take turns on the same batches (so the
machine's background load hits both alike); reports the median tokens/s of each, their spread,
the ratio, the server's raw ``/v1/completions`` baseline on the same batches, and the CPU seconds
each side's processes spent per batch (caller, API server, engine core, worker: where the time
goes), with the load average before and after. Server mode's ``generate`` goes through rlinfer's
batch endpoint (``rlinfer_vllm.api_server.batch_route``); the raw baseline is one call per request.

    .venvs/vllm/bin/python dev/bench/vllm_server_mode.py --runs 7 [--model DIR] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def make_batch(tag: str, prompts: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> list[Any]:
    """Random prompts, exactly ``max_tokens`` sampled tokens each (as ``rlinfer bench``)."""
    import random

    from rlinfer_core.types import GenerateRequest, SamplingParams

    rng = random.Random(seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    return [
        GenerateRequest(
            prompt_token_ids=[rng.randrange(16, vocab) for _ in range(prompt_len)],
            sampling=sampling,
            request_id=f"{tag}-{i}",
        )
        for i in range(prompts)
    ]


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process so far."""
    import psutil  # type: ignore[import-untyped,unused-ignore]

    out = {}
    for role, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[role] = t.user + t.system
    return out


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_core.tiny_model import make_tiny_model
    from rlinfer_core.types import EngineConfig

    model = Path(args.model) if args.model else make_tiny_model(Path(tempfile.mkdtemp()) / "m", seed=0)
    base = {"model": str(model), "seed": 0, "dtype": args.dtype}
    inproc = await AsyncEngine.open("vllm", EngineConfig(**base), load_entry_point_plugins=False)
    server = await AsyncEngine.open("vllm", EngineConfig(**base, mode="server"), load_entry_point_plugins=False)
    try:
        assert inproc.model_info is not None
        vocab = inproc.model_info.vocab_size
        rates: dict[str, list[float]] = {"inprocess": [], "server": [], "server_raw": []}
        me = {"caller": os.getpid()}
        pids = {"inprocess": {**me, **inproc.engine_processes()}, "server": {**me, **server.engine_processes()}}
        pids["server_raw"] = pids["server"]
        cpu: dict[str, list[dict[str, float]]] = {side: [] for side in rates}
        load_before = os.getloadavg()
        for run in range(-1, args.runs):  # run -1 warms every side up
            batch = make_batch(f"r{run}", args.prompts, args.prompt_len, args.max_tokens, vocab, seed=run + 1)
            sides = ["inprocess", "server", "server_raw"]
            if run % 2:
                sides.reverse()
            for side in sides:
                # vLLM's engine core and worker spin-wait for ~1 s after their last step
                # (shm_broadcast.SpinCondition); on a few cores that would slow the next side
                await asyncio.sleep(args.settle_s)
                before = cpu_seconds(pids[side])
                started = time.perf_counter()
                if side == "server_raw":
                    count = await server.bench_raw_generate(batch)
                else:
                    engine = inproc if side == "inprocess" else server
                    count = sum(len(c.token_ids) for c in await engine.generate(batch))
                if run >= 0:
                    rates[side].append(count / (time.perf_counter() - started))
                    after = cpu_seconds(pids[side])
                    cpu[side].append({r: round(after[r] - before[r], 3) for r in after if r in before})
        med = {side: statistics.median(v) for side, v in rates.items()}
        cpu_median = {
            side: {r: statistics.median(run[r] for run in runs) for r in runs[0]} for side, runs in cpu.items() if runs
        }
        return {
            "model": str(model) if args.model else "tiny random Llama (seed 0)",
            "batch": f"{args.prompts} prompts x {args.max_tokens} tokens, median of {args.runs}",
            "settle_s": args.settle_s,
            "tokens_per_s": med,
            "spread": {side: spread(v) for side, v in rates.items()},
            "server_over_inprocess": med["server"] / med["inprocess"],
            "server_over_server_raw": med["server"] / med["server_raw"],
            "server_raw_over_inprocess": med["server_raw"] / med["inprocess"],
            "cpu_seconds_per_batch_median": cpu_median,
            "load_average_before_after": [load_before, os.getloadavg()],
            "cores": os.cpu_count(),
            "runs": rates,
        }
    finally:
        await server.shutdown()
        await inproc.shutdown()


def main() -> None:
    """Parse arguments, run, print (and optionally write) the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--settle-s", type=float, default=1.5, help="idle time before each side's batch")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)


if __name__ == "__main__":
    main()
