"""rlinfer_core.merge: several async streams interleaved into one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rlinfer_core.merge import merge


async def _numbers(start: int, count: int, delay: float) -> AsyncIterator[int]:
    for i in range(count):
        await asyncio.sleep(delay)
        yield start + i


def test_every_item_of_every_stream_arrives_in_each_streams_order() -> None:
    async def collect() -> list[int]:
        return [x async for x in merge([_numbers(0, 3, 0.001), _numbers(100, 4, 0.0015)])]

    got = asyncio.run(collect())
    assert sorted(got) == [0, 1, 2, 100, 101, 102, 103]
    assert [x for x in got if x < 100] == [0, 1, 2]
    assert [x for x in got if x >= 100] == [100, 101, 102, 103]


def test_an_error_in_one_stream_is_raised_and_cancels_the_others() -> None:
    cancelled = asyncio.Event()

    async def forever() -> AsyncIterator[int]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield 1
        finally:
            cancelled.set()

    async def failing() -> AsyncIterator[int]:
        await asyncio.sleep(0.005)
        raise ValueError("sample 1 failed")
        yield 0  # pragma: no cover  (makes this an async generator)

    async def run() -> None:
        with pytest.raises(ValueError, match="sample 1 failed"):
            async for _ in merge([forever(), failing()]):
                pass
        assert cancelled.is_set()

    asyncio.run(run())
