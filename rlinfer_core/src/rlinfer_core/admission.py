"""Which requests the facade has accepted, and the gate that holds new ones while paused.

A request counts as in flight from the moment ``generate``/``stream`` accepts it, before the
engine has seen it. ``pause`` closes the gate first, so a request handed over just before
``pause`` is covered by the pause mode whatever the engine had admitted (issue: a request
submitted just before ``pause(WAIT)`` was still running after it returned).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from rlinfer_core.errors import EngineTimeout


class Admission:
    """In-flight request ids and the pause gate of one engine (one event loop)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight: dict[str, int] = {}

    @property
    def in_flight(self) -> frozenset[str]:
        """Request ids accepted and not returned yet."""
        return frozenset(self._in_flight)

    @contextlib.asynccontextmanager
    async def admit(self, request_ids: Sequence[str], timeout_s: float) -> AsyncIterator[None]:
        """Wait at the gate (while paused), then hold ``request_ids`` in flight for the block."""
        if not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), timeout=timeout_s)
            except TimeoutError:
                raise EngineTimeout(f"generation stayed paused for {timeout_s:.0f} s; call resume()") from None
        for rid in request_ids:
            self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        self._idle.clear()
        try:
            yield
        finally:
            for rid in request_ids:
                left = self._in_flight.pop(rid) - 1
                if left:
                    self._in_flight[rid] = left
            if not self._in_flight:
                self._idle.set()

    def close_gate(self) -> None:
        """New requests wait until :meth:`open_gate`."""
        self._open.clear()

    def open_gate(self) -> None:
        """Let waiting and new requests through."""
        self._open.set()

    async def drained(self) -> None:
        """Return once no accepted request is in flight."""
        await self._idle.wait()
