"""Interleave several async iterators into one, in arrival order (e.g. the samples of one
``n > 1`` request streamed side by side)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Yield items of every stream as they arrive; the first error of any stream is raised, and
    closing the merged stream (or an error) cancels the others."""
    queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(("item", item))
        except BaseException as exc:
            queue.put_nowait(("error", exc))
        finally:
            queue.put_nowait(("done", None))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    pending = len(tasks)
    try:
        while pending:
            kind, value = await queue.get()
            if kind == "done":
                pending -= 1
            elif kind == "error":
                assert isinstance(value, BaseException)
                raise value
            else:
                yield value  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["merge"]
