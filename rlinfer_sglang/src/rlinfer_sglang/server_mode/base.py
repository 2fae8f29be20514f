"""State shared by the server-mode backend's concerns (set in ``SGLangServerBackend.__init__``)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from rlinfer_core.errors import EngineDead
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.server_child import ChildServer
from rlinfer_core.server_http import ServerClient
from rlinfer_core.types import Capabilities, EngineConfig, MemoryTag
from rlinfer_core.weights import TensorSpec
from rlinfer_sglang.capabilities import Platform
from rlinfer_sglang.versions import TokenVersions


class ServerBase:
    """Attributes of one server-mode backend and the helpers every concern uses."""

    config: EngineConfig
    platform: Platform
    engine_version: str
    _caps: Capabilities
    _server: ChildServer | None
    _http: ServerClient | None
    _closed: bool
    _info: ModelInfo | None
    _specs: dict[str, TensorSpec]
    _tp_size: int
    _tokenizer: Any
    #: rlinfer priority -> SGLang's (rlinfer_sglang.convert.priority_sign); None: no priority scheduling
    _priority_sign: int | None
    #: rlinfer request id -> SGLang rids of its samples now in flight
    _rids: dict[str, set[str]]
    _aborted: set[str]
    #: SGLang rids of streams -> tokens received so far
    _received: dict[str, int]
    _gate: asyncio.Event  # set = requests may start
    _idle: asyncio.Event  # set = no sample in flight
    _active: int
    _scoring: int  #: raw-logprob scoring prefills in flight
    _sglang_paused: bool
    _memory_paused: bool
    _released: set[MemoryTag]
    _cache_dirty: bool
    _result_dir: Path
    _group_name: str
    _processor_str: str
    _versions: TokenVersions
    _pause_lock: asyncio.Lock
    _background: set[asyncio.Task[Any]]
    #: the server has /begin_weight_update and /end_weight_update (SGLang >= 0.5.2x; 0.5.16 has
    #: neither): found at start
    _begin_end: bool
    #: the server flushes its cache only when no request is pending, a retracted one included, and
    #: its scheduler dies when the flush inside a weight update fails (SGLang without begin/end,
    #: 0.5.16): updates wait for running requests, flushes go through /flush_cache
    _flush_needs_idle: bool

    def _alive(self) -> ServerClient:
        http = self._http
        if self._closed or http is None:
            raise EngineDead("the SGLang server backend is shut down; open a new engine")
        http.check_processes()
        return http

    def _max_len(self) -> int:
        assert self._info is not None
        return self._info.max_model_len

    def _spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background (fire and forget; errors are dropped)."""

        async def quiet() -> None:
            with contextlib.suppress(Exception):
                await coro

        task = asyncio.ensure_future(quiet())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _processor(self) -> str:
        """SGLang's serialized form of rlinfer's logits processor (built once)."""
        if not self._processor_str:
            from rlinfer_sglang.logits import serialized

            self._processor_str = serialized()
        return self._processor_str
