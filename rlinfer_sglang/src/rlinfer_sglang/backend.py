"""The SGLang backend: rlinfer's operation hooks over one SGLang engine, written once.

Its concerns are written once and shared by both flavours: admission and in-flight tracking
(:mod:`~rlinfer_sglang.inflight`), generate and stream (:mod:`~rlinfer_sglang.generation`, with
:mod:`~rlinfer_sglang.requests` and :mod:`~rlinfer_sglang.outputs`), abort, pause and memory
(:mod:`~rlinfer_sglang.pausing`), weights and the prefix cache (:mod:`~rlinfer_sglang.weights`),
LoRA (:mod:`~rlinfer_sglang.lora`), tool calls (:mod:`~rlinfer_sglang.agent`). A transport
(:mod:`rlinfer_sglang.transport`) makes the engine calls: SGLang's offline ``Engine`` in this
process, or SGLang's HTTP server (``mode="server"`` / ``server_url``). The code that runs inside
SGLang's scheduler process is :mod:`rlinfer_sglang.scheduler`.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rlinfer_core.errors import BackendLoadError, EngineDead, RLInferError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.transfer.arena import engine_arena
from rlinfer_core.types import Capabilities, EngineConfig
from rlinfer_core.weights import TensorSpec
from rlinfer_sglang.agent import AgentHooks
from rlinfer_sglang.capabilities import Platform, capabilities, installed_platform, installed_version, multimodal_off
from rlinfer_sglang.config import resolve_platform
from rlinfer_sglang.generation import Generation
from rlinfer_sglang.inflight import InFlight
from rlinfer_sglang.oom import kv_capacity_tokens
from rlinfer_sglang.pausing import Pausing
from rlinfer_sglang.transport import Served, Transport


class SGLangBackend(Generation, Pausing, AgentHooks):
    """Implements rlinfer's operation hooks for one SGLang engine, over ``transport``."""

    def __init__(self, config: EngineConfig, make_transport: Callable[[EngineConfig, Platform], Transport]) -> None:
        self.config = config
        self.platform = resolve_platform(config, installed_platform())
        version = installed_version()
        self.engine_version = f"sglang {version}" if version else "not installed"
        transport = self._transport = make_transport(config, self.platform)
        self._caps = capabilities(
            self.platform,
            self.engine_version,
            config.enable_memory_release if self.platform == "cuda" else None,
            config.world_size,
            lora=bool(config.engine_kwargs.get("enable_lora", False)),
        ).without(transport.off_before_start)
        self._flight = InFlight(transport.alive)
        self._info = None
        self._specs = {}
        self._tokenizer = None
        self._served_hidden_size = None
        self._priority_sign = None  # set at start
        self._pause_lock = asyncio.Lock()
        self._sglang_paused = False
        self._memory_paused = False
        self._released = set()
        self._result_dir = Path(tempfile.mkdtemp(prefix="rlinfer-sglang-"))
        self._group_name = ""
        self._processor_str = ""
        self._ipc_arena = engine_arena()
        self.start_seconds: float | None = None
        self._lora_init()

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Start the engine (or attach to its server) and read what it serves."""
        started = time.perf_counter()
        served = await self._transport.start(self._caps)
        self._info = self._model_info(served)
        self._specs = self._weight_specs(served)
        self._tokenizer = served.tokenizer
        self._served_hidden_size = served.hidden_size
        self._priority_sign = served.priority_sign
        self._caps = served.capabilities.without(multimodal_off(self.config.model))
        self.start_seconds = time.perf_counter() - started

    def _model_info(self, served: Served) -> ModelInfo:
        eos = set(served.eos_token_ids)
        tok_eos = getattr(served.tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int):
            eos.add(tok_eos)
        # SGLang keeps a few positions of the context in reserve: the longest prompt it accepts is
        # max_req_input_len (context_len - 6 on 0.5.23). Report the length it really serves.
        max_len = served.context_len
        limit = served.max_req_input_len
        if self.config.max_model_len is not None:
            max_len = self.config.max_model_len
        elif limit is not None and 0 < limit < max_len:
            max_len = limit + 1
        return ModelInfo(
            vocab_size=served.vocab_size,
            max_model_len=max_len,
            eos_token_ids=tuple(sorted(eos)),
            tied_weights={"lm_head.weight": "model.embed_tokens.weight"} if served.tied_embeddings else {},
            kv_capacity_tokens=kv_capacity_tokens(limit, max_len),
        )

    def _weight_specs(self, served: Served) -> dict[str, TensorSpec]:
        from rlinfer_core.transfer.disk import read_specs

        # SGLang casts what it loads to the served dtype. With dtype="auto" (where SGLang may serve
        # a float32 checkpoint in float16) the checkpoint's own dtypes are what a trainer holds and
        # what a checkpoint directory contains; with an explicit dtype, that dtype.
        try:
            found = read_specs(served.model_dir)
        except RLInferError as exc:
            raise BackendLoadError(f"cannot read the parameter names of {self.config.model!r}: {exc}") from exc
        return {name: TensorSpec(name, served.served_dtype or spec.dtype, spec.shape) for name, spec in found.items()}

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        """Capabilities on this platform (refined at start: what the engine and its transport can do)."""
        return self._caps

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        """Vocabulary size, context length and EOS ids of the served model."""
        if self._info is None:
            raise EngineDead("the SGLang engine is not started")
        return self._info

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        """Raise EngineDead when an engine process died, the engine does not answer, or it was shut down."""
        await self._transport.check_health()

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
        """Stop the engine; kill exactly the processes its start created (none is left); an
        attached server keeps running."""
        await self._ipc_arena.close(lambda: self._scheduler_op({"op": "release_mapped"}, flush=False))
        await self._transport.shutdown()
        shutil.rmtree(self._result_dir, ignore_errors=True)
        self._lora_cleanup()

    @hookimpl
    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes ("scheduler", "detokenizer", and a
        launched server's "server"); none for an attached server (not this engine's to manage)."""
        return self._transport.processes()

    def engine_processes(self) -> list[int]:
        """Pids of the processes the engine started that are still running."""
        return list(self._transport.processes().values())


if TYPE_CHECKING:
    from typing import Protocol

    from rlinfer_core.backend import (
        AbortingBackend,
        Backend,
        BenchBackend,
        BroadcastBackend,
        ChecksumBackend,
        LoraBackend,
        MemoryBackend,
        PausingBackend,
        PrefixCacheBackend,
        ProcessesBackend,
        StreamingBackend,
        ToolsBackend,
    )

    class _Implemented(
        Backend,
        StreamingBackend,
        AbortingBackend,
        PausingBackend,
        BroadcastBackend,
        ChecksumBackend,
        MemoryBackend,
        PrefixCacheBackend,
        ProcessesBackend,
        BenchBackend,
        ToolsBackend,
        LoraBackend,
        Protocol,
    ):
        """Every protocol of the typed boundary."""

    #: mypy checks the class against those operation hooks (names and signatures)
    _checked: type[_Implemented] = SGLangBackend


__all__ = ["SGLangBackend"]
