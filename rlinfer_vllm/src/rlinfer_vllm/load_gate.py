"""Weight loads sequenced around engine steps, and the caller's pause of vLLM's scheduler.

Exact per-token versions need every engine step to run wholly before or wholly after a load
(:mod:`rlinfer_vllm.versions`). :class:`LoadSequencing` owns the caller's pause and runs each load
the cheapest way that keeps it between two steps: with requests running, a load at the engine
core's step boundary or a pause of vLLM's scheduler in "keep" mode; with none running, holding
this backend's new requests back at the :class:`LoadGate` (no step can run, so none can straddle
the load). The gate counts this backend's requests in the engine, and remembers whether any
reached it since the prefix cache was last reset, so an update after an idle spell skips a reset
that would drop nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from rlinfer_core.types import PauseMode

if TYPE_CHECKING:
    from rlinfer_vllm.transport import Transport

logger = logging.getLogger("rlinfer_vllm.backend")


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


#: how long an update holds new requests back for the admitted ones to finish prefilling, so
#: that loading needs no prefix-cache reset (a reset preempts every running request: on an H100
#: under 128 streams it stalled generation 80-330 ms per update)
PREFILL_SETTLE_S = 0.25

#: ``rpc(method, *args)``: call ``RLInferWorkerExtension.<method>`` in the worker (bytes as bytes)
Rpc = Callable[..., Awaitable[Any]]


class LoadSequencing:
    """Pause and resume for the caller, and the surroundings of every weight load (both flavours)."""

    def __init__(
        self, alive: Callable[[], Transport], gate: LoadGate, reset_prefix_cache: Callable[[], Awaitable[None]]
    ) -> None:
        self._alive = alive  #: the live transport (EngineDead once shut down)
        self._gate = gate
        self._reset_prefix_cache = reset_prefix_cache  #: the backend's (it skips a reset that would drop nothing)
        self._lock = asyncio.Lock()  #: held while pausing, resuming or loading weights
        self._user_pause: PauseMode | None = None  #: the caller's pause mode (None: not paused)

    async def pause(self, mode: PauseMode) -> None:
        """vLLM's pause for the caller; loads meanwhile need no pause of their own."""
        transport = self._alive()
        async with self._lock:
            await transport.pause(mode)
            self._user_pause = mode

    async def resume(self) -> None:
        """vLLM's resume for the caller."""
        transport = self._alive()
        async with self._lock:
            await transport.resume()
            self._user_pause = None

    @contextlib.asynccontextmanager
    async def loading(self, version: int | None) -> AsyncIterator[Rpc]:
        """The ``rpc`` to load an update with, and what surrounds it: no engine step overlaps the
        load, so the boundary between old- and new-version tokens is exact, and the outputs of
        every step after it are labelled ``version`` (None: a load that starts no new version).
        KV caches are kept. Cheapest first:

        - the caller's pause holds the scheduler, or none of our requests is in the engine (a
          gated transport: holding new ones back is enough, :class:`LoadGate`): the worker call
          as it is;
        - the engine core loads between two of its steps (in process,
          :mod:`rlinfer_vllm.engine_core.step_boundary`): one call, no round trip between
          pause, load and resume;
        - else the scheduler is paused in "keep" mode around the load (three round trips).
        """
        transport = self._alive()
        async with self._lock, self._gate.held() as idle:
            if self._user_pause is not None or (idle and transport.gated):
                yield transport.rpc
                await self._after_load(transport, version)
                return
            if version is not None and transport.salted:
                # generation goes on meanwhile; a request still prefilling under the old salt
                # would make the load reset the cache, preempting every running request
                await transport.settle_prefills(PREFILL_SETTLE_S)
            if version is not None and transport.loads_at_step_boundary:
                yield functools.partial(transport.rpc_at_step_boundary, version=version)
                return
            await transport.pause_for_load()
            try:
                yield transport.rpc
                await self._after_load(transport, version)  # before any step runs again
            finally:
                await transport.resume_after_load()

    async def _after_load(self, transport: Transport, version: int | None) -> None:
        """Label later outputs ``version``, and leave no prefix computed by the old weights to a
        request of the new version.

        Salted requests (:mod:`rlinfer_vllm.versions`) need no prefix-cache reset: the new
        version's salt reaches none of the old blocks, and running requests keep their KV. Unless
        a request admitted under the old salt may not have prefilled yet (it would prefill with
        the new weights and could read old blocks): then, as on a transport that cannot salt,
        vLLM's cache is reset (running requests recomputed if they hold blocks). Image embeddings
        are keyed by the image alone, so the encoder cache is always dropped."""
        if version is not None:
            await transport.label_version(version)
        if transport.salted and version is not None and not transport.prefill_pending():
            logger.debug("weight update: prefix cache kept (requests are salted by version)")
            if transport.multimodal:
                await transport.reset_encoder_cache()
            return
        logger.debug("weight update: prefix cache reset (salted: %s)", transport.salted)
        await self._reset_prefix_cache()
