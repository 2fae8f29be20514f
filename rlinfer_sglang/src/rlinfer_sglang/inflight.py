"""Admission and in-flight tracking: which SGLang rids serve which request, abort and pause.

The backend keeps its own gate (closed by pause) and idle event (set when no sample is in flight)
in addition to the facade's admission gate (:mod:`rlinfer_core.admission`); see the README.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import (
    PauseMode,
)
from rlinfer_sglang.base import BackendBase


class InFlight(BackendBase):
    """Admission gate, in-flight SGLang rids, abort, pause and resume."""

    async def _admit(self, request_id: str) -> bool:
        """Wait until requests may start (pause); False when the request was aborted meanwhile."""
        assert self._gate is not None and self._idle is not None
        await self._wait_gate([request_id])
        if request_id in self._aborted:
            return False
        self._active += 1
        self._idle.clear()
        self._cache_dirty = True
        return True

    async def _wait_gate(self, request_ids: list[str]) -> None:
        """Hold requests back while paused; return early once all of them are aborted."""
        assert self._gate is not None
        while not self._gate.is_set() and not all(r in self._aborted for r in request_ids):
            self._alive()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate.wait(), timeout=0.05)

    def _release(self) -> None:
        assert self._idle is not None
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    async def _admit_all(self, request_ids: list[str]) -> list[bool]:
        assert self._gate is not None and self._idle is not None
        await self._wait_gate(request_ids)
        admitted = [rid not in self._aborted for rid in request_ids]
        count = sum(admitted)
        if count:
            self._active += count
            self._idle.clear()
            self._cache_dirty = True
        return admitted

    def _track(self, request_id: str, rid: str) -> None:
        self._rids.setdefault(request_id, set()).add(rid)
        self._versions.admit(rid)

    def _untrack(self, request_id: str, rid: str) -> None:
        rids = self._rids.get(request_id)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self._rids[request_id]

    def _abort_rid(self, rid: str) -> None:
        with contextlib.suppress(Exception):
            self._tm.abort_request(rid=rid)

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request in flight); their callers get "abort"."""
        self._alive()
        ids = list(self._rids) if request_ids is None else list(request_ids)
        for request_id in ids:
            self._aborted.add(request_id)
            for rid in list(self._rids.get(request_id, ())):
                self._abort_rid(rid)
        for request_id in ids:  # ids not in flight now must not poison later requests
            if request_id not in self._rids and (self._gate is None or self._gate.is_set()):
                self._aborted.discard(request_id)

    # --- pause -------------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """abort -> SGLang "abort"; keep -> SGLang "retract"; wait -> rlinfer drains (see README)."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        tm = self._alive()
        assert self._gate is not None and self._idle is not None
        self._gate.clear()
        if mode is PauseMode.WAIT:
            await self._guard(self._idle.wait())
            return
        # raw-logprob scoring prefills already sent finish first (they are short); later ones
        # wait at the gate, so SGLang's pause never aborts or retracts one
        while self._scoring:
            await self._guard(asyncio.sleep(0.01))
        sglang_mode = "abort" if mode is PauseMode.ABORT else "retract"
        if mode is PauseMode.ABORT:
            for rid in [r for rids in self._rids.values() for r in rids]:
                self._abort_rid(rid)
        await self._guard(tm.pause_generation(PauseGenerationReqInput(mode=sglang_mode)))
        self._sglang_paused = True
        if mode is PauseMode.ABORT:
            await self._guard(self._idle.wait())

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """Resume SGLang (if it was paused) and let held-back requests start."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        tm = self._alive()
        assert self._gate is not None
        if self._sglang_paused:
            await self._guard(tm.continue_generation(ContinueGenerationReqInput()))
            self._sglang_paused = False
        self._gate.set()
