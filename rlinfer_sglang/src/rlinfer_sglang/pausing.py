"""Abort, pause and resume, and memory release (which needs SGLang paused), over either transport:
:class:`Pausing` owns whether SGLang is paused, and the lock that orders pauses and weight updates."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import attrs

from rlinfer_core.types import Capabilities, Capability, MemoryTag, PauseMode
from rlinfer_sglang.inflight import InFlight
from rlinfer_sglang.transport import Transport


@attrs.define(eq=False)
class Pausing:
    """Abort, pause, resume, and memory release and resume, over ``transport``."""

    _transport: Transport
    _flight: InFlight
    _capabilities: Callable[[], Capabilities]
    _reset_prefix_cache: Callable[[], Awaitable[None]]
    #: pause, resume and weight updates one at a time
    lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _sglang_paused: bool = attrs.field(default=False, init=False)
    _memory_paused: bool = attrs.field(default=False, init=False)  # by release_memory (needs an idle scheduler)
    _released: set[MemoryTag] = attrs.field(factory=set, init=False)

    @property
    def paused(self) -> bool:
        """SGLang is paused, by a pause or for released memory."""
        return self._sglang_paused or self._memory_paused

    async def drain_scoring(self) -> None:
        """Let the raw-logprob scoring prefills already sent finish (they are short; later ones wait
        at the gate), so SGLang never aborts, retracts or reloads under one."""
        while self._flight.scoring:
            self._transport.alive()
            await self._transport.guard(asyncio.sleep(0.01))

    async def abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request in flight); a transport whose requests may not
        have reached SGLang yet aborts them again (bounded by its ``abort_settle_s``)."""
        flight, transport = self._flight, self._transport
        transport.alive()
        ids = list(flight.rids) if request_ids is None else list(request_ids)
        flight.aborted.update(ids)
        deadline = time.monotonic() + transport.abort_settle_s
        while True:
            rids = [rid for request_id in ids for rid in flight.rids.get(request_id, ())]
            if rids:
                await transport.abort(rids)
            if not rids or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.01)
        flight.settle(ids)

    async def pause(self, mode: PauseMode) -> None:
        """Close the gate; abort -> SGLang "abort", keep -> SGLang "retract", wait -> drain here."""
        flight, transport = self._flight, self._transport
        transport.alive()
        async with self.lock:
            flight.gate.clear()
            if mode is PauseMode.WAIT:
                await transport.guard(flight.idle.wait())
                return
            await self.drain_scoring()
            if mode is PauseMode.ABORT:
                rids = flight.all_rids()
                if rids:
                    await transport.abort(rids)
            await transport.pause("abort" if mode is PauseMode.ABORT else "retract")
            self._sglang_paused = True
            if mode is PauseMode.ABORT:
                await transport.guard(flight.idle.wait())

    async def resume(self) -> None:
        """Unpause SGLang if a pause paused it, and open the gate."""
        self._transport.alive()
        async with self.lock:
            if self._sglang_paused:
                await self._transport.unpause()
                self._sglang_paused = False
            self._flight.gate.set()

    async def release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool) -> None:
        """Free ``tags`` with SGLang's memory saver, which needs an idle scheduler: requests in
        flight are aborted and SGLang stays paused until every released tag is resumed."""
        self._capabilities().require(Capability.MEMORY_RELEASE)
        if discard_weights:  # never claimed: SGLang fixes the weights' host backup at start
            self._capabilities().require(Capability.MEMORY_DISCARD_WEIGHTS)
        transport = self._transport
        transport.alive()
        await self.abort(None)
        if not self.paused:
            await transport.pause("abort")
            self._memory_paused = True
        await transport.guard(self._flight.idle.wait())
        await transport.release_memory(sorted(t.value for t in tags))
        self._released |= tags

    async def resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """Re-allocate ``tags`` (weights come back from the host backup); unpause once none is released."""
        self._capabilities().require(Capability.MEMORY_RELEASE)
        self._transport.alive()
        await self._transport.resume_memory(sorted(t.value for t in tags))
        self._released -= tags
        if MemoryTag.KV_CACHE in tags:
            self._flight.cache_dirty = True
            await self._reset_prefix_cache()
        if self._memory_paused and not self._released:
            await self._transport.unpause()
            self._memory_paused = False
