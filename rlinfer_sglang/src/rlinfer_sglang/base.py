"""State every concern of the SGLang backend reads (set in ``SGLangBackend.__init__`` and at start)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rlinfer_core.errors import EngineDead
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.transfer.arena import PackArena
from rlinfer_core.types import Capabilities, EngineConfig, MemoryTag
from rlinfer_core.weights import TensorSpec
from rlinfer_sglang.capabilities import Platform
from rlinfer_sglang.inflight import InFlight
from rlinfer_sglang.transport import Transport


class BackendBase:
    """The backend's components and the few attributes its concerns share."""

    config: EngineConfig
    platform: Platform
    _caps: Capabilities
    #: makes the engine calls (in process or over HTTP)
    _transport: Transport
    #: the samples in flight and the backend's gate
    _flight: InFlight
    _info: ModelInfo | None
    _specs: dict[str, TensorSpec]
    _tokenizer: Any
    _served_hidden_size: int | None
    #: rlinfer priority -> SGLang's (rlinfer_sglang.requests.priority_sign); None: no priority scheduling
    _priority_sign: int | None
    #: pause, resume and weight updates one at a time
    _pause_lock: asyncio.Lock
    _sglang_paused: bool
    _memory_paused: bool  # SGLang paused by release_memory (it needs an idle scheduler)
    _released: set[MemoryTag]
    #: where the scheduler-side loader writes its outcome, a file per TP rank
    _result_dir: Path
    _group_name: str
    _processor_str: str
    #: the buffers CUDA tensors are packed into for the scheduler, reused while the layout stays
    _ipc_arena: PackArena

    def _model(self) -> ModelInfo:
        if self._info is None:
            raise EngineDead("the SGLang engine is not started")
        return self._info

    def _max_len(self) -> int:
        return self._model().max_model_len
