"""Which requests the facade has accepted, and the gate that holds new ones while paused.

A request counts as in flight from the moment ``generate``/``stream`` accepts it, before the
engine has seen it. ``pause`` closes the gate first, so a request handed over just before
``pause`` is covered by the pause mode whatever the engine had admitted (issue: a request
submitted just before ``pause(WAIT)`` was still running after it returned).

A request waiting at the gate can still be aborted: :meth:`Admission.abort_waiting` releases it
with ``Ticket.aborted`` set, and the facade returns it aborted with no tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from rlinfer_core.errors import EngineTimeout


class Ticket:
    """What :meth:`Admission.admit` hands the caller: whether the request was aborted at the gate."""

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = frozenset(request_ids)
        self.aborted = False
        self.released = asyncio.Event()


class Admission:
    """In-flight request ids and the pause gate of one engine (one event loop)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight: dict[str, int] = {}
        self._waiting: list[Ticket] = []

    @property
    def in_flight(self) -> frozenset[str]:
        """Request ids accepted and not returned yet."""
        return frozenset(self._in_flight)

    @property
    def waiting(self) -> frozenset[str]:
        """Request ids held at the closed gate (accepted, not in flight yet)."""
        return frozenset(rid for ticket in self._waiting for rid in ticket.request_ids)

    @contextlib.asynccontextmanager
    async def admit(self, request_ids: Sequence[str], timeout_s: float) -> AsyncIterator[Ticket]:
        """Wait at the gate (while paused), then hold ``request_ids`` in flight for the block.

        The ticket says whether the request was aborted while it waited; then the caller must not
        hand it to the engine.
        """
        ticket = Ticket(request_ids)
        if not self._open.is_set():
            self._waiting.append(ticket)
            try:
                gate = asyncio.ensure_future(self._open.wait())
                released = asyncio.ensure_future(ticket.released.wait())
                done, pending = await asyncio.wait({gate, released}, timeout=timeout_s, return_when="FIRST_COMPLETED")
                for task in pending:
                    task.cancel()
                if not done:
                    raise EngineTimeout(f"generation stayed paused for {timeout_s:.0f} s; call resume()")
            finally:
                self._waiting.remove(ticket)
        if ticket.aborted:
            yield ticket
            return
        for rid in request_ids:
            self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        self._idle.clear()
        try:
            yield ticket
        finally:
            for rid in request_ids:
                left = self._in_flight.pop(rid) - 1
                if left:
                    self._in_flight[rid] = left
            if not self._in_flight:
                self._idle.set()

    def abort_waiting(self, request_ids: Sequence[str] | None) -> None:
        """Release requests waiting at the gate as aborted (``None``: every waiting one)."""
        for ticket in self._waiting:
            if request_ids is None or ticket.request_ids & set(request_ids):
                ticket.aborted = True
                ticket.released.set()

    def close_gate(self) -> None:
        """New requests wait until :meth:`open_gate`."""
        self._open.clear()

    def open_gate(self) -> None:
        """Let waiting and new requests through."""
        self._open.set()

    async def drained(self) -> None:
        """Return once no accepted request is in flight."""
        await self._idle.wait()
