"""How much device memory each memory tag frees on one engine (with CUDA graphs on).

Usage (on the device, after ``source dev/gpu/env.sh E``):
``python3 dev/gpu/bench/memory_tag_probe.py --backend sglang --model /tmp/rlinfer_model --json-out F``

Per tag: ``release_memory([tag])`` and ``resume_memory([tag])`` alone, the free device memory
before and after each (``torch.cuda.mem_get_info``, device-wide), their latency, and one greedy
generation afterwards. The tags asked for are sent to the backend's release hook even where the
backend does not claim them (so an unclaimed tag can be measured before claiming it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any


def _free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


async def probe(backend: str, model: str, tags: list[str], engine_args: dict[str, Any]) -> dict[str, Any]:
    """Release and resume each tag alone on one engine; MiB freed and given back, seconds."""
    from rlinfer_core.backend import MemoryBackend
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_core.types import EngineConfig, GenerateRequest, MemoryTag, SamplingParams

    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        device="cuda",
        seed=0,
        enable_memory_release=True,
        enforce_eager=False,
        gpu_memory_utilization=0.3,
        engine_kwargs=engine_args,
    )
    engine = await AsyncEngine.open(backend, config)
    request = GenerateRequest(prompt_token_ids=list(range(10, 40)), sampling=SamplingParams(max_tokens=16))
    out: dict[str, Any] = {"engine": engine.capabilities.engine_version}
    try:
        await engine.generate([request])
        # the hooks themselves, past the facade's tag check: a tag is measured before it is claimed
        release = engine._calls.optional(MemoryBackend.rlinfer_release_memory)
        resume = engine._calls.optional(MemoryBackend.rlinfer_resume_memory)
        for tag in tags:
            before = _free_bytes()
            started = time.perf_counter()
            await release(frozenset({MemoryTag(tag)}))
            release_s = time.perf_counter() - started
            released = _free_bytes()
            started = time.perf_counter()
            await resume(frozenset({MemoryTag(tag)}))
            resume_s = time.perf_counter() - started
            resumed = _free_bytes()
            tokens = (await engine.generate([request]))[0].token_ids
            out[tag] = {
                "freed_mib": (released - before) / 2**20,
                "given_back_mib": (released - resumed) / 2**20,
                "release_s": release_s,
                "resume_s": resume_s,
                "tokens_after": len(tokens),
            }
            print(tag, out[tag], flush=True)
    finally:
        await engine.shutdown()
    return out


def main() -> None:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tags", default="cuda_graph,kv_cache,weights")
    parser.add_argument("--engine-arg", action="append", default=[], help="KEY=VALUE (JSON values)")
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args()
    from rlinfer_core.assignments import parse_assignments

    result = asyncio.run(probe(args.backend, args.model, args.tags.split(","), parse_assignments(args.engine_arg)))
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
