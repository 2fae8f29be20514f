"""Over-sampling: submit a batch, return once a fraction of it has finished, abort the tail.

RL rollouts often over-sample (more prompts than a training step needs) and cut the slowest ones,
whose long generations would otherwise hold the whole step back. :func:`generate_over_sampled`
(``engine.generate_over_sampled(requests, over_sample_rate=0.8)``) submits every request at once,
waits until ``ceil(over_sample_rate * len(requests))`` of them have finished, aborts the others and
returns every completion, in request order then sample index, as :meth:`AsyncEngine.generate`
does. The aborted ones are marked ``finish_reason == "abort"`` and hold the tokens generated until
the abort (a prefix of what the request would have produced, with their logprobs and versions).

Engine-agnostic: built on ``generate`` and ``abort`` (capability ``abort``) of an engine or of an
rlinfer-ray pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.preflight import as_batch
from rlinfer_core.types import Capabilities, Capability, Completion, GenerateRequest


class Generating(Protocol):
    """What over-sampling needs: an AsyncEngine (over any backend, an rlinfer-ray pool included)."""

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Generate ``requests`` to their end."""
        ...

    async def abort(self, request_ids: Sequence[str] | str | None = None) -> None:
        """Abort ``request_ids``."""
        ...


def finished_needed(count: int, over_sample_rate: float) -> int:
    """How many of ``count`` requests must finish before the rest are aborted (at least one)."""
    if isinstance(over_sample_rate, bool) or not isinstance(over_sample_rate, int | float):
        raise InvalidRequest("over_sample_rate", f"must be a number in (0, 1], got {over_sample_rate!r}")
    if not 0.0 < over_sample_rate <= 1.0:
        raise InvalidRequest("over_sample_rate", f"must be in (0, 1], got {over_sample_rate!r}")
    return max(1, math.ceil(over_sample_rate * count - 1e-9))  # 0.5 * 8 is 4, not 5 by rounding


async def generate_over_sampled(
    engine: Generating,
    requests: GenerateRequest | Sequence[GenerateRequest],
    over_sample_rate: float,
    capabilities: Capabilities,
    check: Callable[[GenerateRequest], Any],
) -> list[Completion]:
    """Generate ``requests``; once ``ceil(over_sample_rate * len(requests))`` have finished, abort
    the rest and return every completion (the aborted ones with ``finish_reason="abort"`` and their
    partial tokens). A request counts as finished when all its ``n`` samples have. Each request is
    checked (``check``: the caller's request checks) before any is submitted; an error of one
    request aborts the others and is raised."""
    batch = as_batch(requests, check)
    needed = finished_needed(len(batch), over_sample_rate)
    if not batch:
        return []
    if needed < len(batch):
        capabilities.require(Capability.ABORT)
    tasks = [asyncio.ensure_future(engine.generate([request])) for request in batch]
    owner = {task: request.request_id for task, request in zip(tasks, batch, strict=True)}
    pending = set(tasks)
    try:
        while pending and len(tasks) - len(pending) < needed:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a request's error is the call's error
        if pending:
            await engine.abort([owner[task] for task in pending])
        results = await asyncio.gather(*tasks)
    except BaseException:
        left = [owner[task] for task in tasks if not task.done()]
        if left:
            with contextlib.suppress(Exception):  # the first error is what the caller gets
                await engine.abort(left)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return [completion for result in results for completion in result]
