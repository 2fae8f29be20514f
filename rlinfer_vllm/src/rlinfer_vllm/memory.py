"""The vLLM backend's memory hooks (a mixin, both flavours): vLLM sleep mode on CUDA, refused on
CPU (vLLM frees nothing there)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import Capabilities, Capability, MemoryTag

if TYPE_CHECKING:
    from rlinfer_vllm.transport import Transport


class MemoryHooks:
    """``rlinfer_release_memory`` / ``rlinfer_resume_memory`` of
    :class:`rlinfer_vllm.backend.VllmBackend`."""

    _caps: Capabilities
    _asleep: set[MemoryTag]
    _implicitly_asleep: set[MemoryTag]

    def _alive(self) -> Transport:
        raise NotImplementedError

    async def rlinfer_reset_prefix_cache(self) -> None:
        """Implemented by the backend."""
        raise NotImplementedError

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """GPU: vLLM sleep mode (level 2 with ``discard_weights``: the weights are dropped, not
        offloaded). CPU: UnsupportedCapability (vLLM frees nothing there)."""
        self._caps.require(Capability.MEMORY_RELEASE)
        if discard_weights:
            self._caps.require(Capability.MEMORY_DISCARD_WEIGHTS)
        transport = self._alive()
        # a tag already released along with the other one: now the caller owns it
        for tag in tags & self._implicitly_asleep:
            self._implicitly_asleep.discard(tag)
            tags = tags - {tag}
        kv_only = transport.kv_cache_release  # vLLM >= 0.32
        if MemoryTag.WEIGHTS in tags or (MemoryTag.KV_CACHE in tags and not kv_only):
            # level 1 offloads weights to host memory and discards the KV cache (level 2 discards
            # both): whatever of the two was not asked for is woken up again with the tags that were
            await transport.sleep(level=2 if discard_weights else 1)
            both = {MemoryTag.WEIGHTS, MemoryTag.KV_CACHE}
            self._implicitly_asleep |= both - tags - self._asleep
            self._asleep |= both
        elif MemoryTag.KV_CACHE in tags:
            await transport.release_kv_cache()
            self._asleep.add(MemoryTag.KV_CACHE)

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: vLLM wake_up for ``tags`` (and the KV cache released along with the weights)."""
        self._caps.require(Capability.MEMORY_RELEASE)
        transport = self._alive()
        wake = (set(tags) | self._implicitly_asleep) & self._asleep
        if not wake:
            return
        await transport.wake_up(sorted(t.value for t in wake))
        self._asleep -= wake
        self._implicitly_asleep -= wake
        if MemoryTag.KV_CACHE in wake:
            await self.rlinfer_reset_prefix_cache()
