"""Admission, in-flight SGLang rids, abort and pause over HTTP (as in-process:
:mod:`rlinfer_sglang.inflight`).

The backend keeps its own gate (closed by pause and during a weight update) and idle event in
addition to the facade's admission gate. Abort is SGLang's ``/abort_request`` per rid; a request
whose HTTP call has not reached the server yet is unknown to SGLang (it ignores the abort), so
abort repeats until every aborted request has ended (bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import PauseMode
from rlinfer_sglang.server_mode.base import ServerBase

#: how long abort() keeps re-aborting requests that the server had not registered yet
ABORT_SETTLE_S = 2.0


class InFlight(ServerBase):
    """Admission gate, in-flight rids, abort, pause and resume."""

    @contextlib.asynccontextmanager
    async def _gate_closed(self) -> AsyncIterator[None]:
        """New requests wait at the gate for the block; it reopens after unless it was closed
        already (a pause keeps it closed)."""
        closed_here = self._gate.is_set()
        self._gate.clear()
        try:
            yield
        finally:
            if closed_here:
                self._gate.set()

    async def _wait_gate(self, request_ids: list[str]) -> None:
        """Hold requests back while paused; return early once all of them are aborted."""
        while not self._gate.is_set() and not all(r in self._aborted for r in request_ids):
            self._alive()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate.wait(), timeout=0.05)

    async def _admit_all(self, request_ids: list[str]) -> list[bool]:
        await self._wait_gate(request_ids)
        admitted = [rid not in self._aborted for rid in request_ids]
        count = sum(admitted)
        if count:
            self._active += count
            self._idle.clear()
            self._cache_dirty = True
        return admitted

    def _release(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    def _track(self, request_id: str, rid: str) -> None:
        self._rids.setdefault(request_id, set()).add(rid)
        self._versions.admit(rid)

    def _untrack(self, request_id: str, rid: str) -> None:
        rids = self._rids.get(request_id)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self._rids[request_id]
        self._received.pop(rid, None)

    async def _abort_rids(self, rids: Sequence[str]) -> None:
        http = self._alive()
        await asyncio.gather(*(http.post("/abort_request", {"rid": rid}) for rid in rids))

    def _abort_later(self, rids: Sequence[str]) -> None:
        """Abort ``rids`` from a cancelled call (in the background: it must not block)."""
        if rids and not self._closed:
            self._spawn(self._abort_rids(list(rids)))

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request in flight); their callers get "abort"."""
        self._alive()
        ids = list(self._rids) if request_ids is None else list(request_ids)
        for request_id in ids:
            self._aborted.add(request_id)
        deadline = time.monotonic() + ABORT_SETTLE_S
        while True:
            rids = [rid for request_id in ids for rid in self._rids.get(request_id, ())]
            if rids:
                await self._abort_rids(rids)
            if not rids or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        for request_id in ids:  # ids not in flight now must not poison later requests
            if request_id not in self._rids and self._gate.is_set():
                self._aborted.discard(request_id)

    # --- pause -------------------------------------------------------------------------------

    async def _sglang_pause(self, mode: str) -> None:
        await self._alive().post("/pause_generation", {"mode": mode})

    async def _sglang_continue(self) -> None:
        await self._alive().post("/continue_generation", {})

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """abort -> SGLang "abort"; keep -> SGLang "retract"; wait -> rlinfer drains (as in-process)."""
        self._alive()
        async with self._pause_lock:
            self._gate.clear()
            if mode is PauseMode.WAIT:
                await self._idle.wait()
                return
            # raw-logprob scoring prefills already sent finish first; later ones wait at the gate
            while self._scoring:
                self._alive()
                await asyncio.sleep(0.01)
            if mode is PauseMode.ABORT:
                rids = [r for rids in self._rids.values() for r in rids]
                if rids:
                    await self._abort_rids(rids)
            await self._sglang_pause("abort" if mode is PauseMode.ABORT else "retract")
            self._sglang_paused = True
            if mode is PauseMode.ABORT:
                await self._idle.wait()

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """Resume SGLang (if it was paused) and let held-back requests start."""
        self._alive()
        async with self._pause_lock:
            if self._sglang_paused:
                await self._sglang_continue()
                self._sglang_paused = False
            self._gate.set()
