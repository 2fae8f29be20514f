"""Paired timing for the benches: named *sides* run the same work back to back.

Every run gives each side the same batch (or the same weights), in an order that rotates from run
to run, so drift (other load on the machine, thermal, caches) hits every side alike. Ratios are
taken per run (paired) and summarised (:mod:`rlinfer_demo.bench_stats`); run -1 warms every side
up and is not counted. :func:`with_control` adds the A/A control: the baseline side once more, right
after itself, so baseline/baseline_control is alternated like the ratio it is the noise floor of.
Pure asyncio + stdlib: no engine, no torch (``dev/gpu/bench`` scripts use it too).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from rlinfer_demo.bench_stats import CONTROL_SUFFIX, ratios, summary

_Side = TypeVar("_Side")

#: a generate side: runs a batch, returns the number of tokens it produced
GenerateSide = Callable[[list[Any]], Awaitable[int]]
#: a weight-update side: loads weight set ``which`` (0 or 1, alternating)
UpdateSide = Callable[[int], Awaitable[Any]]


def make_batch(tag: str, prompts: int, prompt_len: int, max_tokens: int, vocab: int, seed: int = 0) -> list[Any]:
    """A fixed batch: random prompts, exactly ``max_tokens`` sampled tokens each."""
    from rlinfer_core.types import GenerateRequest, SamplingParams

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


def rotated(names: Sequence[str], run: int) -> list[str]:
    """``names`` starting at position ``run`` (mod len): each side leads equally often."""
    k = run % len(names) if names else 0
    return [*names[k:], *names[:k]]


async def time_generate(
    sides: Mapping[str, GenerateSide], batch: Callable[[int], list[Any]], runs: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Tokens/s of every side on ``batch(run)``, per timed run; and tokens per run of each side."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, int] = {}
    for run in range(-1, runs):
        work = batch(run)
        for name in rotated(list(sides), run):
            started = time.perf_counter()
            count = await sides[name](work)
            seconds = time.perf_counter() - started
            if run >= 0:
                rates[name].append(count / seconds)
            tokens[name] = count
    return rates, tokens


async def time_updates(sides: Mapping[str, UpdateSide], runs: int) -> dict[str, list[float]]:
    """Seconds of every side's update per timed run; weight sets alternate so every update changes
    the weights (run -1 loads set 1, run 0 set 0, ...)."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for run in range(-1, runs):
        for name in rotated(list(sides), run):
            started = time.perf_counter()
            await sides[name](run % 2)
            if run >= 0:
                seconds[name].append(time.perf_counter() - started)
    return seconds


def with_control(sides: Mapping[str, _Side], baseline: str) -> dict[str, _Side]:
    """``sides`` with ``baseline`` timed once more as ``baseline_control``, right after it in the
    rotation: the A/A control. Placed after a side compared with the one before it (``rlinfer``,
    ``raw``), baseline/baseline_control meets the same order pattern and warm-up as that ratio."""
    out: dict[str, _Side] = {}
    for name, side in sides.items():
        out[name] = side
        if name == baseline:
            out[baseline + CONTROL_SUFFIX] = side
    return out


def paired(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """Per-run ratios ``numerator / denominator``: median, min, max, IQR, 95 % CI, the samples."""
    return summary(ratios(numerator, denominator))


def spread(samples: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``samples``."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def machine_load() -> dict[str, Any]:
    """The machine's CPU count and 1/5/15-minute load averages (other work shares the machine)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpus": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in load]}
