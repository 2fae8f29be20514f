"""State shared by the backend's concerns, and the few helpers every one of them uses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rlinfer_core.errors import EngineDead, InvalidRequest
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.types import Capabilities, EngineConfig, MemoryTag
from rlinfer_core.weights import TensorSpec
from rlinfer_sglang.capabilities import Platform
from rlinfer_sglang.oom import out_of_memory
from rlinfer_sglang.versions import TokenVersions

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine

T = TypeVar("T")


class BackendBase:
    """Attributes of one SGLang backend (set in ``SGLangBackend.__init__``) and shared helpers."""

    config: EngineConfig
    platform: Platform
    engine_version: str
    _caps: Capabilities
    _engine: Engine | None
    _tm: Any  #: SGLang's TokenizerManager (in this process)
    _closed: bool
    _dead: str | None
    _dead_event: asyncio.Event | None
    _procs: list[Any]
    _monitor: asyncio.Task[None] | None
    _info: ModelInfo | None
    _specs: dict[str, TensorSpec]
    _tp_size: int
    #: rlinfer request id -> SGLang rids of its samples now in flight
    _rids: dict[str, set[str]]
    _aborted: set[str]
    _gate: asyncio.Event | None  # set = requests may start
    _idle: asyncio.Event | None  # set = no sample in flight
    _active: int
    _sglang_paused: bool
    _memory_paused: bool  # SGLang paused by release_memory (it needs an idle scheduler)
    _released: set[MemoryTag]
    _cache_dirty: bool
    _result_dir: Path
    _signals: dict[int, Any]
    _quit_guard: str
    start_seconds: float | None
    #: rlinfer priority -> SGLang's (rlinfer_sglang.convert.priority_sign); None: no priority scheduling
    _priority_sign: int | None = None
    _group_name: str = ""
    _processor_str: str = ""
    _scoring: int = 0  #: raw-logprob scoring prefills in flight
    _versions: TokenVersions

    def _lora_cleanup(self) -> None:
        """Remove the LoRA adapters' temporary directories (at shutdown)."""

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        if self._dead_event is not None:
            self._dead_event.set()

    def _alive(self) -> Any:
        if self._closed or self._tm is None:
            raise EngineDead("the SGLang engine is shut down; open a new engine")
        if self._dead is not None:
            raise EngineDead(f"the SGLang engine died ({self._dead}); open a new engine")
        return self._tm

    async def _guard(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` unless the engine dies first (then raise EngineDead)."""
        assert self._dead_event is not None
        task = asyncio.ensure_future(awaitable)
        dead = asyncio.ensure_future(self._dead_event.wait())
        try:
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            dead.cancel()
            raise
        dead.cancel()
        if task.done():
            return task.result()
        task.cancel()
        self._alive()
        raise EngineDead("the SGLang engine died")

    def _max_len(self) -> int:
        assert self._info is not None
        return self._info.max_model_len

    def _translate(self, exc: Exception) -> Exception:
        if self._dead is not None:
            return EngineDead(f"the SGLang engine died ({self._dead}): {exc}")
        oom = out_of_memory(str(getattr(exc, "detail", None) or exc), self._info)
        if oom is not None:  # a ValueError (HTTP 400) or fastapi's HTTPException (500, 503)
            return oom
        if isinstance(exc, ValueError):
            return InvalidRequest("request", f"SGLang rejected it: {exc}")
        return exc
