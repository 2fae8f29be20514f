"""The SGLang backend: rlinfer's operation hooks over SGLang's offline ``Engine``.

SGLang's Engine keeps its tokenizer manager in the caller's process and event loop and runs the
scheduler (model + KV cache) and the detokenizer in child processes. This object drives the
tokenizer manager's async API directly (the Engine's sync wrappers would block the loop).

Weight updates go through SGLang's ``update_weights_from_tensor`` (inside
``begin_weight_update``/``end_weight_update``) with rlinfer's scheduler-side loader
(:mod:`rlinfer_sglang.scheduler_side`), which reads and checks everything before loading.
Concerns live in their own modules: :mod:`~rlinfer_sglang.supervision` (processes, signals,
death, shutdown), :mod:`~rlinfer_sglang.inflight` (admission, abort, pause),
:mod:`~rlinfer_sglang.generation` (generate, stream), :mod:`~rlinfer_sglang.weight_channel`
(weights through the scheduler) and :mod:`~rlinfer_sglang.memory`.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlinfer_core.errors import BackendLoadError, EngineDead, RLInferError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.types import (
    Capabilities,
    Capability,
    EngineConfig,
    MemoryTag,
)
from rlinfer_core.weights import (
    TensorSpec,
)
from rlinfer_sglang import convert
from rlinfer_sglang.agent import AgentHooks
from rlinfer_sglang.capabilities import (
    HIDDEN_STATES_OFF_NOTE,
    OVERLAP_NOTE,
    PAUSE_KEEP_OLD_SGLANG_NOTE,
    PRIORITY_OFF_NOTE,
    ROUTES_OFF_NOTE,
    capabilities,
    installed_platform,
    installed_version,
    multimodal_off,
)
from rlinfer_sglang.config import resolve_platform
from rlinfer_sglang.generation import Generation
from rlinfer_sglang.memory import Memory
from rlinfer_sglang.oom import kv_capacity_tokens
from rlinfer_sglang.supervision import Supervision
from rlinfer_sglang.versions import TokenVersions
from rlinfer_sglang.weight_channel import flush_needs_idle

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine


def create(config: EngineConfig) -> SGLangBackend:
    """Factory named by the ``rlinfer.backends: sglang`` entry point."""
    return SGLangBackend(config)


AMX_NOTE = (
    "sgl-kernel's CPU ops are installed: SGLang repacks linear weights for AMX after loading, so "
    "model.named_parameters() is not what the kernels read"
)


def _amx_repacks() -> bool:
    """True when SGLang's CPU path repacks weights (a real CPU sgl-kernel with AMX ops)."""
    try:
        from sglang.srt.utils.common import cpu_has_amx_support

        return bool(cpu_has_amx_support())
    except Exception:
        return False


class SGLangBackend(Supervision, Generation, Memory, AgentHooks):
    """Implements rlinfer's operation hooks for one SGLang engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config, installed_platform())
        version = installed_version()
        self.engine_version = f"sglang {version}" if version else "not installed"
        self._caps = capabilities(
            self.platform,
            self.engine_version,
            config.enable_memory_release if self.platform == "cuda" else None,
            config.world_size,
            lora=bool(config.engine_kwargs.get("enable_lora", False)),
        )
        self._engine: Engine | None = None
        self._tm: Any = None
        self._closed = False
        self._dead: str | None = None
        self._dead_event: asyncio.Event | None = None
        self._procs: list[Any] = []
        self._monitor: asyncio.Task[None] | None = None
        self._info: ModelInfo | None = None
        self._specs: dict[str, TensorSpec] = {}
        self._tp_size = config.world_size  # SGLang's tp_size: every rank of the engine
        #: rlinfer request id -> SGLang rids of its samples now in flight
        self._rids: dict[str, set[str]] = {}
        self._aborted: set[str] = set()
        self._gate: asyncio.Event | None = None  # set = requests may start
        self._idle: asyncio.Event | None = None  # set = no sample in flight
        self._active = 0
        self._sglang_paused = False
        self._memory_paused = False  # SGLang paused by release_memory (it needs an idle scheduler)
        self._released: set[MemoryTag] = set()
        self._cache_dirty = True
        self._result_dir = Path(tempfile.mkdtemp(prefix="rlinfer-sglang-"))
        self._signals: dict[int, Any] = {}
        self._quit_guard = ""
        self.start_seconds: float | None = None
        self._versions = TokenVersions()
        self._lora_init()
        self._priority_sign = None  # set at start, from SGLang's server args

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Start SGLang's Engine (scheduler + detokenizer processes) and take over its process care."""
        started = time.perf_counter()
        await self._launch(config)
        self._info = self._model_info()
        self._specs = self._weight_specs()
        self._priority_sign = convert.priority_sign(getattr(self._tm, "server_args", None))
        self._caps = self._runtime_capabilities()
        self.start_seconds = time.perf_counter() - started

    def _model_info(self) -> ModelInfo:
        mc = self._tm.model_config
        eos = sorted(int(t) for t in (getattr(mc, "hf_eos_token_id", None) or ()))
        tokenizer = getattr(self._tm, "tokenizer", None)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in eos:
            eos.append(tok_eos)
        # SGLang keeps a few positions of the context in reserve: the longest prompt it accepts is
        # max_req_input_len (context_len - 6 on 0.5.23). Report the length it really serves.
        max_len = int(mc.context_len)
        limit = getattr(self._tm, "max_req_input_len", None)
        if self.config.max_model_len is not None:
            max_len = self.config.max_model_len
        elif isinstance(limit, int) and 0 < limit < max_len:
            max_len = limit + 1
        tied = bool(getattr(getattr(mc, "hf_text_config", None) or mc.hf_config, "tie_word_embeddings", False))
        return ModelInfo(
            vocab_size=int(mc.vocab_size),
            max_model_len=max_len,
            eos_token_ids=tuple(eos),
            tied_weights={"lm_head.weight": "model.embed_tokens.weight"} if tied else {},
            kv_capacity_tokens=kv_capacity_tokens(limit, max_len),
        )

    def _weight_specs(self) -> dict[str, TensorSpec]:
        from rlinfer_core.transfer.disk import read_specs

        # SGLang casts what it loads to the served dtype. With dtype="auto" (where SGLang may serve
        # a float32 checkpoint in float16) the checkpoint's own dtypes are what a trainer holds and
        # what a checkpoint directory contains; with an explicit dtype, that dtype.
        served = None if self.config.dtype == "auto" else str(self._tm.model_config.dtype).removeprefix("torch.")
        try:
            found = read_specs(self._model_dir())
        except RLInferError as exc:
            raise BackendLoadError(f"cannot read the parameter names of {self.config.model!r}: {exc}") from exc
        return {name: TensorSpec(name, served or spec.dtype, spec.shape) for name, spec in found.items()}

    def _model_dir(self) -> str:
        if Path(self.config.model).is_dir():
            return self.config.model
        from huggingface_hub import snapshot_download

        return str(snapshot_download(self.config.model, allow_patterns=["*.safetensors", "*.json"]))

    def _runtime_capabilities(self) -> Capabilities:
        """What this engine can do once started (its configuration and SGLang version decide)."""
        off: dict[Capability, str] = {}
        if getattr(getattr(self._tm, "tokenizer", None), "chat_template", None) is None:
            off[Capability.CHAT] = "the model's tokenizer has no chat template"
        if self.platform == "cpu" and Capability.WEIGHTS_CHECKSUM in self._caps.supported and _amx_repacks():
            off[Capability.WEIGHTS_CHECKSUM] = AMX_NOTE
        if not getattr(getattr(self._tm, "server_args", None), "disable_overlap_schedule", True):
            off[Capability.SAMPLING_PENALTIES] = OVERLAP_NOTE
        if flush_needs_idle():
            off[Capability.PAUSE_KEEP] = PAUSE_KEEP_OLD_SGLANG_NOTE
        if self._priority_sign is None:
            off[Capability.PRIORITY] = PRIORITY_OFF_NOTE
        if not getattr(getattr(self._tm, "server_args", None), "enable_return_routed_experts", False):
            off[Capability.GENERATE_ROUTED_EXPERTS] = (
                "the model has no routed experts (or no local config.json)"
                if self.config.enable_routed_experts
                else ROUTES_OFF_NOTE
            )
        if not getattr(getattr(self._tm, "server_args", None), "enable_return_hidden_states", False):
            off[Capability.GENERATE_HIDDEN_STATES] = HIDDEN_STATES_OFF_NOTE
        off.update(multimodal_off(self.config.model))
        return self._caps.without(off)

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        """Capabilities on this platform (refined at start: chat needs a chat template)."""
        return self._caps

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        """Vocabulary size, context length and EOS ids of the served model."""
        if self._info is None:
            raise EngineDead("the SGLang engine is not started")
        return self._info


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


__all__ = ["SGLangBackend", "create"]
