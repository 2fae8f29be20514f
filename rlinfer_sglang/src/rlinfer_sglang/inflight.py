"""Admission and in-flight tracking: which SGLang rids serve which request, the backend's gate.

The backend keeps its own gate (closed by pause and during a weight update) and idle event (set
when no sample is in flight) in addition to the facade's admission gate
(:mod:`rlinfer_core.admission`); see the README.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from rlinfer_sglang.versions import TokenVersions


class InFlight:
    """The samples SGLang serves now, by rlinfer request id, and the gate new ones wait at."""

    def __init__(self, alive: Callable[[], object]) -> None:
        #: raises EngineDead once the engine is gone (checked while waiting)
        self._alive = alive
        #: rlinfer request id -> SGLang rids of its samples now in flight
        self.rids: dict[str, set[str]] = {}
        self.aborted: set[str] = set()
        #: SGLang rids of streams -> tokens received so far
        self.received: dict[str, int] = {}
        self.gate = asyncio.Event()  # set = requests may start
        self.gate.set()
        self.idle = asyncio.Event()  # set = no sample in flight
        self.idle.set()
        self.active = 0
        self.scoring = 0  #: raw-logprob scoring prefills in flight
        #: a request ran since SGLang's cache was last flushed
        self.cache_dirty = True
        self.versions = TokenVersions()

    def all_rids(self) -> list[str]:
        """SGLang rids of every sample in flight."""
        return [r for rids in self.rids.values() for r in rids]

    async def wait_gate(self, request_ids: list[str] | None = None) -> None:
        """Hold requests back while paused; return early once all of ``request_ids`` are aborted."""
        ids = request_ids or []
        while not self.gate.is_set() and not (ids and all(r in self.aborted for r in ids)):
            self._alive()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gate.wait(), timeout=0.05)

    async def admit_all(self, request_ids: list[str]) -> list[bool]:
        """Wait at the gate; then whether each sample may run (False: aborted meanwhile)."""
        await self.wait_gate(request_ids)
        admitted = [rid not in self.aborted for rid in request_ids]
        count = sum(admitted)
        if count:
            self.active += count
            self.idle.clear()
            self.cache_dirty = True
        return admitted

    def release(self) -> None:
        """One admitted sample ended."""
        self.active -= 1
        if self.active == 0:
            self.idle.set()

    def track(self, request_id: str, rid: str) -> None:
        """Sample ``rid`` of ``request_id`` is sent to SGLang."""
        self.rids.setdefault(request_id, set()).add(rid)
        self.versions.admit(rid)

    def untrack(self, request_id: str, rid: str) -> None:
        """Sample ``rid`` ended (its versions stay until ``versions.forget``)."""
        rids = self.rids.get(request_id)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self.rids[request_id]
        self.received.pop(rid, None)

    def settle(self, request_ids: list[str], *, held: bool = True) -> None:
        """Ids not in flight now must not poison later requests (``held``: unless the gate is closed,
        where a request aborted while it waits must stay aborted)."""
        for request_id in request_ids:
            if request_id not in self.rids and not (held and not self.gate.is_set()):
                self.aborted.discard(request_id)

    @contextlib.asynccontextmanager
    async def gate_closed(self) -> AsyncIterator[None]:
        """New requests wait at the gate for the block; it reopens after unless it was closed
        already (a pause keeps it closed)."""
        closed_here = self.gate.is_set()
        self.gate.clear()
        try:
            yield
        finally:
            if closed_here:
                self.gate.set()

    @contextlib.asynccontextmanager
    async def scoring_prefill(self) -> AsyncIterator[None]:
        """A raw-logprob scoring prefill: it starts after a pause (at the gate), and a pause lets
        those already sent finish first (they are short), so SGLang never aborts or retracts one."""
        await self.wait_gate()
        self.scoring += 1
        try:
            yield
        finally:
            self.scoring -= 1
