"""Server-mode memory hooks (a mixin): vLLM's /sleep, /release_kv_cache_memory and /wake_up on
CUDA (sleep mode), refused on CPU like in-process (vLLM frees nothing there)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import Capabilities, Capability, MemoryTag
from rlinfer_vllm.server_mode.http import ServerClient


class ServerMemoryHooks:
    """``rlinfer_release_memory`` / ``rlinfer_resume_memory`` of the server-mode backend."""

    _caps: Capabilities
    _asleep: set[MemoryTag]
    _implicitly_asleep: set[MemoryTag]
    _features: Mapping[str, Any]

    def _alive(self) -> ServerClient:
        raise NotImplementedError

    async def rlinfer_reset_prefix_cache(self) -> None:
        """Implemented by the backend."""
        raise NotImplementedError

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """GPU: ``/sleep?level=1`` (weights, and the KV cache with them; ``level=2`` with
        ``discard_weights``: weights dropped, not offloaded) or ``/release_kv_cache_memory`` (vLLM
        0.26 has none: the KV cache alone goes with ``/sleep?level=1``, as in-process);
        CPU: UnsupportedCapability."""
        self._caps.require(Capability.MEMORY_RELEASE)
        if discard_weights:
            self._caps.require(Capability.MEMORY_DISCARD_WEIGHTS)
        http = self._alive()
        for tag in tags & self._implicitly_asleep:
            self._implicitly_asleep.discard(tag)
            tags = tags - {tag}
        kv_only = bool(self._features.get("release_kv_cache_memory", True))  # vLLM 0.26 lacks it
        if MemoryTag.WEIGHTS in tags or (MemoryTag.KV_CACHE in tags and not kv_only):
            # level 1 also discards the KV cache; whatever was not asked for wakes with the tags
            await http.post("/sleep", params={"level": 2 if discard_weights else 1, "mode": "abort"})
            both = {MemoryTag.WEIGHTS, MemoryTag.KV_CACHE}
            self._implicitly_asleep |= both - tags - self._asleep
            self._asleep |= both
        elif MemoryTag.KV_CACHE in tags:
            await http.post("/pause", params={"mode": "abort"})
            await http.post("/release_kv_cache_memory")
            self._asleep.add(MemoryTag.KV_CACHE)

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: ``/wake_up?tags=...`` for ``tags`` (and the KV cache released with the weights)."""
        self._caps.require(Capability.MEMORY_RELEASE)
        http = self._alive()
        wake = (set(tags) | self._implicitly_asleep) & self._asleep
        if not wake:
            return
        await http.post("/wake_up", params=[("tags", t.value) for t in sorted(wake)])  # type: ignore[arg-type]
        self._asleep -= wake
        self._implicitly_asleep -= wake
        if MemoryTag.KV_CACHE in wake:
            await self.rlinfer_reset_prefix_cache()
