"""Abort, pause and resume, and memory release (which needs SGLang paused), over either transport."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import Capability, MemoryTag, PauseMode
from rlinfer_sglang.weights import Weights


class Pausing(Weights):
    """``rlinfer_abort``, ``rlinfer_pause``, ``rlinfer_resume``, ``rlinfer_release_memory``,
    ``rlinfer_resume_memory``."""

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request in flight); their callers get "abort"."""
        flight, transport = self._flight, self._transport
        transport.alive()
        ids = list(flight.rids) if request_ids is None else list(request_ids)
        flight.aborted.update(ids)
        # a transport whose requests may not have reached SGLang yet re-aborts them (bounded)
        deadline = time.monotonic() + transport.abort_settle_s
        while True:
            rids = [rid for request_id in ids for rid in flight.rids.get(request_id, ())]
            if rids:
                await transport.abort(rids)
            if not rids or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.01)
        flight.settle(ids)

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """abort -> SGLang "abort"; keep -> SGLang "retract"; wait -> rlinfer drains (see README)."""
        flight, transport = self._flight, self._transport
        transport.alive()
        async with self._pause_lock:
            flight.gate.clear()
            if mode is PauseMode.WAIT:
                await transport.guard(flight.idle.wait())
                return
            await self._drain_scoring()
            if mode is PauseMode.ABORT:
                rids = flight.all_rids()
                if rids:
                    await transport.abort(rids)
            await transport.pause("abort" if mode is PauseMode.ABORT else "retract")
            self._sglang_paused = True
            if mode is PauseMode.ABORT:
                await transport.guard(flight.idle.wait())

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """Resume SGLang (if it was paused) and let held-back requests start."""
        self._transport.alive()
        async with self._pause_lock:
            if self._sglang_paused:
                await self._transport.unpause()
                self._sglang_paused = False
            self._flight.gate.set()

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """GPU: SGLang's memory saver. CPU: UnsupportedCapability (SGLang frees nothing there).

        SGLang requires an idle scheduler: in-flight requests are aborted and SGLang stays
        paused (new requests wait) until every released tag is resumed.
        """
        self._caps.require(Capability.MEMORY_RELEASE)
        if discard_weights:  # never claimed: SGLang fixes the weights' host backup at start
            self._caps.require(Capability.MEMORY_DISCARD_WEIGHTS)
        transport = self._transport
        transport.alive()
        await self.rlinfer_abort(None)
        if not self._sglang_paused and not self._memory_paused:
            await transport.pause("abort")
            self._memory_paused = True
        await transport.guard(self._flight.idle.wait())
        await transport.release_memory(sorted(t.value for t in tags))
        self._released |= tags

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: re-allocate what release freed (weights come back from the host backup)."""
        self._caps.require(Capability.MEMORY_RELEASE)
        self._transport.alive()
        await self._transport.resume_memory(sorted(t.value for t in tags))
        self._released -= tags
        if MemoryTag.KV_CACHE in tags:
            self._flight.cache_dirty = True
            await self.rlinfer_reset_prefix_cache()
        if self._memory_paused and not self._released:
            await self._transport.unpause()
            self._memory_paused = False
