"""Memory control of the vLLM backend (both flavours): vLLM sleep mode on CUDA, refused on CPU
(vLLM frees nothing there)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from rlinfer_core.types import Capabilities, Capability, MemoryTag

if TYPE_CHECKING:
    from rlinfer_vllm.transport import Transport


class MemoryControl:
    """Which memory tags of one vLLM engine are released, and which went along with the others."""

    def __init__(
        self,
        alive: Callable[[], Transport],
        capabilities: Callable[[], Capabilities],
        reset_prefix_cache: Callable[[], Awaitable[None]],
    ) -> None:
        self._alive = alive  #: the live transport (EngineDead once shut down)
        self._capabilities = capabilities  #: the backend's current ones (refined at start)
        self._reset_prefix_cache = reset_prefix_cache  #: the backend's reset
        self._asleep: set[MemoryTag] = set()
        self._implicitly_asleep: set[MemoryTag] = set()  #: released along with a tag asked for, not asked for itself

    async def release(self, tags: frozenset[MemoryTag], discard_weights: bool) -> None:
        """GPU: vLLM sleep mode for ``tags`` (level 2 with ``discard_weights``). CPU: UnsupportedCapability."""
        self._capabilities().require(Capability.MEMORY_RELEASE)
        if discard_weights:
            self._capabilities().require(Capability.MEMORY_DISCARD_WEIGHTS)
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

    async def resume(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: vLLM wake_up for ``tags`` (and the KV cache released along with the weights)."""
        self._capabilities().require(Capability.MEMORY_RELEASE)
        transport = self._alive()
        wake = (set(tags) | self._implicitly_asleep) & self._asleep
        if not wake:
            return
        await transport.wake_up(sorted(t.value for t in wake))
        self._asleep -= wake
        self._implicitly_asleep -= wake
        if MemoryTag.KV_CACHE in wake:
            await self._reset_prefix_cache()
