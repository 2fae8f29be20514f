"""Running a batch as concurrent requests (in-process and server mode alike)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from rlinfer_core.types import Completion, GenerateRequest


async def complete_all(
    requests: Sequence[GenerateRequest], complete: Callable[[GenerateRequest], Awaitable[list[Completion]]]
) -> list[Completion]:
    """``complete`` every request concurrently; their completions in request order. If one fails
    (or the caller is cancelled), the others are cancelled and awaited before the error propagates."""
    tasks = [asyncio.ensure_future(complete(r)) for r in requests]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return [c for group in results for c in group]
