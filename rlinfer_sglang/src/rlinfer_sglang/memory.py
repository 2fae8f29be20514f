"""Memory release/resume (SGLang's memory saver; GPU only)."""

from __future__ import annotations

from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import (
    Capability,
    MemoryTag,
)
from rlinfer_sglang.inflight import InFlight
from rlinfer_sglang.weight_channel import WeightChannel


class Memory(WeightChannel, InFlight):
    """``rlinfer_release_memory`` / ``rlinfer_resume_memory``."""

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """GPU: SGLang's memory saver. CPU: UnsupportedCapability (SGLang frees nothing there).

        SGLang requires an idle scheduler: in-flight requests are aborted and SGLang stays
        paused (new requests wait) until every released tag is resumed.
        """
        from sglang.srt.managers.io_struct import PauseGenerationReqInput, ReleaseMemoryOccupationReqInput

        self._caps.require(Capability.MEMORY_RELEASE)
        if discard_weights:  # never claimed: SGLang fixes the weights' host backup at start
            self._caps.require(Capability.MEMORY_DISCARD_WEIGHTS)
        tm = self._alive()
        await self.rlinfer_abort(None)
        if not self._sglang_paused and not self._memory_paused:
            await self._guard(tm.pause_generation(PauseGenerationReqInput(mode="abort")))
            self._memory_paused = True
        assert self._idle is not None
        await self._guard(self._idle.wait())
        await self._guard(
            tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=sorted(t.value for t in tags)), None)
        )
        self._released |= tags

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: re-allocate what release freed (weights come back from the host backup)."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, ResumeMemoryOccupationReqInput

        self._caps.require(Capability.MEMORY_RELEASE)
        tm = self._alive()
        await self._guard(
            tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=sorted(t.value for t in tags)), None)
        )
        self._released -= tags
        if MemoryTag.KV_CACHE in tags:
            self._cache_dirty = True
            await self.rlinfer_reset_prefix_cache()
        if self._memory_paused and not self._released:
            await self._guard(tm.continue_generation(ContinueGenerationReqInput()))
            self._memory_paused = False
