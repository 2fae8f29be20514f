"""Weight loads without a scheduler pause when the engine is idle.

Exact per-token versions need every engine step to run wholly before or wholly after a load
(:mod:`rlinfer_vllm.versions`). With requests running, the backend gets that from a pause of
vLLM's scheduler in "keep" mode, two engine-core round trips. With none running, holding this
backend's new requests back for the load is enough: no step can run, so none can straddle it.

:class:`LoadGate` counts this backend's requests in the engine and holds new ones back while a
load runs. It also remembers whether any request reached the engine since the prefix cache was
last reset, so an update after an idle spell skips a reset that would drop nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable


class Entry:
    """One request's pass through the gate; :meth:`done` ends it early (e.g. once the engine
    reported it finished while a slow stream consumer still reads)."""

    def __init__(self, gate: LoadGate, admitted: bool) -> None:
        self._gate = gate
        self.admitted = admitted  #: False: aborted while it waited; the engine never saw it
        self._counted = admitted

    def done(self) -> None:
        """The engine has no more work for this request."""
        if self._counted:
            self._counted = False
            self._gate._active -= 1


class LoadGate:
    """The backend's requests in the engine, and the gate a weight load closes (one event loop)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._active = 0
        self._waiting: dict[str, int] = {}
        self._aborted: set[str] = set()
        #: a request reached the engine since the prefix cache was last reset
        self.cache_dirty = True

    @property
    def cache_stale(self) -> bool:
        """The prefix cache may hold blocks computed before now: a request ran since the last
        reset, or one is running (it keeps adding blocks after a reset)."""
        return self.cache_dirty or self._active > 0

    def cache_was_reset(self) -> None:
        """The prefix cache was just reset; requests still running count as having run since."""
        self.cache_dirty = self._active > 0

    @property
    def idle(self) -> bool:
        """No request of this backend is in the engine."""
        return self._active == 0

    @contextlib.asynccontextmanager
    async def enter(self, request_id: str) -> AsyncIterator[Entry]:
        """Wait while a load holds the gate, then count the request as in the engine for the block."""
        self._waiting[request_id] = self._waiting.get(request_id, 0) + 1
        try:
            while not self._open.is_set():  # re-check: a load may close it again before we run
                await self._open.wait()
        finally:
            left = self._waiting.pop(request_id) - 1
            if left:
                self._waiting[request_id] = left
        if request_id in self._aborted:
            self._aborted.discard(request_id)
            yield Entry(self, admitted=False)
            return
        self._active += 1
        self.cache_dirty = True
        entry = Entry(self, admitted=True)
        try:
            yield entry
        finally:
            entry.done()

    def abort_waiting(self, request_ids: Iterable[str] | None) -> None:
        """Requests waiting at the gate come out not admitted (``None``: all of them)."""
        ids = set(self._waiting) if request_ids is None else set(request_ids) & set(self._waiting)
        self._aborted |= ids

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[bool]:
        """Hold new requests back for the block; yields whether the engine has none of ours (then
        none can reach it before the block ends)."""
        self._open.clear()
        try:
            yield self._active == 0
        finally:
            self._open.set()
