"""An optional, bounded retry of generation turned away for transient KV-cache pressure.

Off by default: ``AsyncEngine.open(..., oom_retry=OutOfMemoryRetry(attempts=3))`` turns it on.
Only an :class:`~rlinfer_core.errors.EngineOutOfMemory` with ``transient=True`` is retried (the
request could fit an emptier cache); one that can never fit is raised at once. Each attempt is
bounded by ``EngineConfig.request_timeout_s`` on its own; the waits between them add at most
``attempts * max_backoff_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import attrs

from rlinfer_core import _validate as v
from rlinfer_core.errors import EngineOutOfMemory

T = TypeVar("T")


@attrs.frozen
class OutOfMemoryRetry:
    """How often, and after which waits, a transient EngineOutOfMemory is retried.

    The n-th retry waits ``min(initial_backoff_s * multiplier**(n-1), max_backoff_s)`` seconds.
    """

    #: retries after the first try; 0 (the default) turns retrying off
    attempts: int = attrs.field(default=0, validator=v.in_range(0, 100, integer=True))
    initial_backoff_s: float = attrs.field(default=0.5, validator=v.in_range(0.0, 600.0))
    max_backoff_s: float = attrs.field(default=8.0, validator=v.in_range(0.0, 600.0))
    multiplier: float = attrs.field(default=2.0, validator=v.in_range(1.0, 100.0))

    def delays(self) -> Iterator[float]:
        """The wait before each retry, in order (``attempts`` of them)."""
        delay = self.initial_backoff_s
        for _ in range(self.attempts):
            yield min(delay, self.max_backoff_s)
            delay *= self.multiplier


async def retrying_out_of_memory(
    call: Callable[[], Awaitable[T]],
    policy: OutOfMemoryRetry,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """``await call()``, calling it again after each transient EngineOutOfMemory while ``policy``
    has retries left; the last error (or a non-transient one at once) is raised."""
    delays = policy.delays()
    while True:
        try:
            return await call()
        except EngineOutOfMemory as exc:
            if not exc.transient:
                raise
            delay = next(delays, None)
            if delay is None:
                raise
            await sleep(delay)
