"""Memory release/resume over HTTP: SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation`` (its memory saver; CUDA only, as in-process: SGLang frees nothing
on CPU, so there the capability is not claimed and the facade refuses the call)."""

from __future__ import annotations

from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import Capability, MemoryTag
from rlinfer_sglang.server_mode.weights import ServerWeights


class ServerMemory(ServerWeights):
    """``rlinfer_release_memory`` / ``rlinfer_resume_memory`` (as :mod:`rlinfer_sglang.memory`)."""

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """SGLang requires an idle scheduler: in-flight requests are aborted and SGLang stays
        paused (new requests wait) until every released tag is resumed."""
        self._caps.require(Capability.MEMORY_RELEASE)
        if discard_weights:  # never claimed: SGLang fixes the weights' host backup at start
            self._caps.require(Capability.MEMORY_DISCARD_WEIGHTS)
        http = self._alive()
        await self.rlinfer_abort(None)
        if not self._sglang_paused and not self._memory_paused:
            await self._sglang_pause("abort")
            self._memory_paused = True
        await self._idle.wait()
        await http.post("/release_memory_occupation", {"tags": sorted(t.value for t in tags)})
        self._released |= tags

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """Re-allocate what release freed (weights come back from the host backup)."""
        self._caps.require(Capability.MEMORY_RELEASE)
        http = self._alive()
        await http.post("/resume_memory_occupation", {"tags": sorted(t.value for t in tags)})
        self._released -= tags
        if MemoryTag.KV_CACHE in tags:
            self._cache_dirty = True
            await self.rlinfer_reset_prefix_cache()
        if self._memory_paused and not self._released:
            await self._sglang_continue()
            self._memory_paused = False
