"""The vLLM backend: rlinfer's operation hooks over ``vllm.v1.engine.async_llm.AsyncLLM``.

vLLM's AsyncLLM runs the engine core (scheduler) and its worker in child processes; this object
lives in the caller's process and event loop. Weight updates reach the worker through
``collective_rpc`` into :class:`rlinfer_vllm.worker.RLInferWorkerExtension`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlinfer_core import processes
from rlinfer_core.errors import (
    BackendLoadError,
    EngineDead,
    InvalidRequest,
    RLInferError,
    UnsupportedCapability,
)
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.tools import ToolCalls, ToolSpec
from rlinfer_core.types import (
    Capabilities,
    Capability,
    EngineConfig,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import (
    TensorSpec,
)
from rlinfer_vllm.bench import BenchHooks
from rlinfer_vllm.capabilities import (
    PRIORITY_OFF_NOTE,
    capabilities,
    installed_engine,
    installed_platform,
    lora_refused,
)
from rlinfer_vllm.config import engine_args, engine_environment, resolve_platform
from rlinfer_vllm.generation import Generation
from rlinfer_vllm.load_gate import LoadGate
from rlinfer_vllm.lora import LoraHooks
from rlinfer_vllm.memory import MemoryHooks
from rlinfer_vllm.staging import StagingHooks
from rlinfer_vllm.tools import ToolParsing
from rlinfer_vllm.versions import TokenVersions
from rlinfer_vllm.weights import WeightHooks

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


logger = logging.getLogger(__name__)

#: how long abort() keeps re-aborting requests that were not registered in vLLM yet
ABORT_SETTLE_S = 2.0

#: how often calls look for exited engine processes (a dead worker -> EngineDead)
PROCESS_CHECK_S = 0.2
#: how long vLLM's own shutdown may take before rlinfer kills what is left of the engine
SHUTDOWN_TIMEOUT_S = 30.0

#: vLLM's structured-output settings unless engine_kwargs set them: xgrammar (what "auto" picks
#: for the constraints rlinfer sends) generating JSON without free whitespace, so that a model
#: cannot spend its token budget on it (any valid document is still reachable, compactly)
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


def create(config: EngineConfig) -> Any:
    """Factory named by the ``rlinfer.backends: vllm`` entry point: the in-process backend, or
    with ``mode="server"`` / ``server_url`` the one over vLLM's HTTP server."""
    if config.server_mode:
        from rlinfer_vllm.server_mode.backend import VllmServerBackend

        return VllmServerBackend(config)
    return VllmBackend(config)


class VllmBackend(WeightHooks, StagingHooks, MemoryHooks, BenchHooks, LoraHooks, Generation):
    """Implements rlinfer's operation hooks for one vLLM engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config, installed_platform())
        found = installed_engine()
        self.engine_version = f"{found[0]} {found[1]}" if found else "not installed"
        self._caps = capabilities(
            self.platform,
            self.engine_version,
            config.enable_memory_release if self.platform == "cuda" else None,
            inprocess=True,
            lora=bool(config.engine_kwargs.get("enable_lora", False)),
        )
        #: why this engine's configuration cannot serve the LoRA it asks for (refused at start)
        self._lora_refused = (
            lora_refused(self.platform, config.dtype) if config.engine_kwargs.get("enable_lora") else None
        )
        if self._lora_refused is not None:
            self._caps = self._caps.without({Capability.LORA: self._lora_refused})
        self._llm: AsyncLLM | None = None
        self._closed = False
        self._specs: dict[str, TensorSpec] = {}
        self._info: ModelInfo | None = None
        self._inflight: set[str] = set()
        self._gate = LoadGate()
        self._engine_procs: list[Any] = []
        self._asleep: set[MemoryTag] = set()
        self._implicitly_asleep: set[MemoryTag] = set()
        self._versions: TokenVersions | None = None
        self._dead_pids: list[int] = []
        self._procs_checked_at = 0.0
        #: held while pausing, resuming or loading weights; _user_pause: the caller's pause mode
        self._pause_lock = asyncio.Lock()
        self._user_pause: PauseMode | None = None
        self.start_seconds: float | None = None
        self._tool_parsing: ToolParsing | None = None
        self._lora_init()

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Start AsyncLLM (engine core + worker processes), then build the worker's weight shadow."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._lora_refused is not None:  # the engine core would die at start
            raise UnsupportedCapability(Capability.LORA.value, "vllm", self._lora_refused)
        started = time.perf_counter()
        before = processes.snapshot()
        kwargs = engine_args(config, self.platform)
        # compact JSON under json_schema constraints: vLLM reads the whitespace switch per engine
        kwargs.setdefault("structured_outputs_config", dict(STRUCTURED_OUTPUTS))
        try:
            args = AsyncEngineArgs(**kwargs)
        except Exception as exc:
            raise BackendLoadError(f"vLLM rejected the engine configuration: {exc}") from exc
        try:  # from_engine_args blocks until the engine is up
            with engine_environment(config, self.platform):
                llm = await processes.start_in_thread(
                    lambda: AsyncLLM.from_engine_args(args), lambda f: _shutdown_late(f, before)
                )
        except Exception as exc:
            processes.reap(processes.started_since(before), timeout_s=5.0)
            raise BackendLoadError(f"vLLM failed to start for model {config.model!r}: {exc}") from exc
        self._llm = llm
        self._engine_procs = processes.started_since(before)
        self._versions = TokenVersions(llm)
        # dtype="auto": updates come in the checkpoint's dtypes (vLLM may serve a float32
        # checkpoint in a half type and casts on load); an explicit dtype: in that dtype
        specs = (await llm.collective_rpc("rlinfer_init", args=(config.dtype == "auto",)))[0]
        self._specs = {name: TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in specs}
        self._info = self._model_info(llm)
        self._caps = self._runtime_capabilities(llm)
        self.start_seconds = time.perf_counter() - started

    def _model_info(self, llm: AsyncLLM) -> ModelInfo:
        model_config = llm.model_config
        eos: list[int] = []
        tokenizer = llm.tokenizer
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.append(int(tokenizer.eos_token_id))
        hf_eos = getattr(model_config.hf_config, "eos_token_id", None)
        for token in hf_eos if isinstance(hf_eos, list) else [hf_eos]:
            if token is not None and int(token) not in eos:
                eos.append(int(token))
        tied = {}
        if getattr(model_config.hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in self._specs:
            tied["lm_head.weight"] = "model.embed_tokens.weight"
        return ModelInfo(
            vocab_size=int(model_config.get_vocab_size()),
            max_model_len=int(model_config.max_model_len),
            eos_token_ids=tuple(eos),
            tied_weights=tied,
        )

    def _runtime_capabilities(self, llm: AsyncLLM) -> Capabilities:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
        if device != self.platform:
            raise BackendLoadError(f"vLLM runs on {device!r}, expected {self.platform!r}")
        off: dict[Capability, str] = {}
        if llm.vllm_config.scheduler_config.policy != "priority":
            off[Capability.PRIORITY] = PRIORITY_OFF_NOTE
        if llm.vllm_config.lora_config is None:
            off[Capability.LORA] = "vLLM started without a LoRA config (enable_lora)"
        if llm.model_config.quantization is not None or self.config.tensor_parallel_size != 1:
            off[Capability.WEIGHTS_CHECKSUM] = "needs an unquantized model and tensor_parallel_size=1"
        if getattr(llm.tokenizer, "chat_template", None) is None:
            off[Capability.CHAT] = "the model's tokenizer has no chat template"
        if not llm.model_config.is_multimodal_model:
            off[Capability.MULTIMODAL] = "the served model takes no images (not a vision-language model)"
        return self._caps.without(off)

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        """Capabilities on this platform (refined at start: chat needs a chat template)."""
        return self._caps

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        """Vocabulary size, context length and EOS ids of the served model."""
        if self._info is None:
            raise EngineDead("the vLLM engine is not started")
        return self._info

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        """Raise EngineDead when the engine core died or the engine was shut down."""
        self._alive()

    def _alive(self) -> AsyncLLM:
        llm = self._llm
        if self._closed or llm is None:
            raise EngineDead("the vLLM engine is shut down; open a new engine")
        if llm.errored:
            raise EngineDead(f"the vLLM engine core died ({llm.dead_error}); open a new engine")
        gone = self._dead_processes()
        if gone:
            raise EngineDead(f"vLLM engine process(es) {gone} died; open a new engine")
        return llm

    def _dead_processes(self) -> list[int]:
        """Pids of engine processes (engine core, workers) that are no longer running; looked up
        at most every PROCESS_CHECK_S (it reads /proc per process, and runs per request)."""
        now = time.monotonic()
        if now - self._procs_checked_at >= PROCESS_CHECK_S or self._dead_pids:
            running = {p.pid for p in processes.alive(self._engine_procs)}
            self._dead_pids = [p.pid for p in self._engine_procs if p.pid not in running]
            self._procs_checked_at = now
        return self._dead_pids

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
        """Shut AsyncLLM down and make sure its engine core and worker processes are gone."""
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None
        if llm is not None:
            # stop the output handler first, or it logs the engine core's exit as a failure
            if llm.output_handler is not None:
                llm.output_handler.cancel()
            loop = asyncio.get_running_loop()
            try:
                if llm.errored or self._dead_processes():
                    # a process died: the others may wait on it forever (a tensor-parallel peer
                    # inside a collective), so vLLM's orderly shutdown would hang; stop them first
                    await loop.run_in_executor(None, processes.kill, self._engine_procs)
                try:
                    await asyncio.wait_for(loop.run_in_executor(None, llm.shutdown), SHUTDOWN_TIMEOUT_S)
                except TimeoutError:
                    logger.warning("vLLM's shutdown took over %.0f s; killing its processes", SHUTDOWN_TIMEOUT_S)
                    await loop.run_in_executor(None, processes.kill, self._engine_procs)
                # AsyncLLM.__del__ calls shutdown() again, possibly at interpreter exit when
                # vLLM's module globals are gone; it is done (or given up) already.
                llm.shutdown = _already_shut_down  # type: ignore[method-assign,unused-ignore]
            finally:
                await loop.run_in_executor(None, processes.reap, self._engine_procs)
                self._lora_cleanup()

    def engine_processes(self) -> list[int]:
        """Pids of the processes the engine started that are still running."""
        return [p.pid for p in processes.alive(self._engine_procs)]

    @hookimpl
    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes, by vLLM's process titles
        (``EngineCore``, ``Worker-0``...; others by their name)."""
        roles: dict[str, int] = {}
        workers = 0
        for proc in sorted(processes.alive(self._engine_procs), key=lambda p: p.pid):
            try:
                title = proc.name()
            except Exception:  # exited meanwhile
                continue
            if "EngineCore" in title:
                role = "EngineCore"
            elif "Worker" in title:
                role, workers = f"Worker-{workers}", workers + 1
            else:
                role = f"{title}-{proc.pid}"
            roles[role] = proc.pid
        return roles

    def _translate(self, exc: Exception) -> Exception:
        import vllm.exceptions
        from vllm.v1.engine.exceptions import EngineDeadError

        # VLLMClientError exists from vLLM 0.27; VLLMValidationError is a ValueError before
        client_errors = (ValueError, getattr(vllm.exceptions, "VLLMClientError", ValueError))

        if isinstance(exc, RLInferError):
            return exc
        if isinstance(exc, EngineDeadError) or (self._llm is not None and self._llm.errored):
            return EngineDead(f"the vLLM engine core died: {exc}; open a new engine")
        self._procs_checked_at = 0.0  # look now: the error may be the first sign
        gone = self._dead_processes()
        if gone:  # a dead worker surfaces as vLLM's EngineGenerateError before the core notices
            return EngineDead(f"vLLM engine process(es) {gone} died ({type(exc).__name__}: {exc}); open a new engine")
        if isinstance(exc, client_errors):
            return InvalidRequest("request", f"vLLM rejected it: {exc}")
        return exc

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request in flight); their callers get "abort"."""
        llm = self._alive()
        ids = list(self._inflight) if request_ids is None else list(request_ids)
        self._gate.abort_waiting(ids)
        if not ids:
            return
        await llm.abort(ids)
        # A request whose generate() began but that vLLM has not registered yet ignores the
        # abort; abort again until every one of them has ended (bounded).
        deadline = time.monotonic() + ABORT_SETTLE_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            left = [i for i in ids if i in self._inflight]
            if not left:
                return
            await llm.abort(left)

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """vLLM's pause_generation; "keep" also keeps the KV cache of the frozen requests."""
        llm = self._alive()
        async with self._pause_lock:
            await self._drain_scoring(self.config.request_timeout_s)  # raw-logprob prefills: short
            await llm.pause_generation(mode=mode.value, clear_cache=mode != PauseMode.KEEP)
            self._user_pause = mode

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """vLLM's resume_generation."""
        llm = self._alive()
        async with self._pause_lock:
            await llm.resume_generation()
            self._user_pause = None

    # --- tools -----------------------------------------------------------------------------------

    @hookimpl
    def rlinfer_parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Tool calls in ``text`` by vLLM's own parser (:mod:`rlinfer_vllm.tools`)."""
        if self._tool_parsing is None:
            self._tool_parsing = ToolParsing(self._alive().tokenizer)
        return self._tool_parsing.parse(text, parser, tools)

    # --- weight sync ---------------------------------------------------------------------------

    async def _rpc(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every worker (one per tensor-parallel rank); rank 0's result once
        every rank succeeded (:mod:`rlinfer_vllm.ranks`)."""
        from rlinfer_vllm.ranks import rank_zero_result

        llm = self._alive()
        try:
            outcomes = await llm.collective_rpc(
                "rlinfer_call", timeout=self.config.request_timeout_s, args=(method, *args)
            )
        except Exception as exc:
            if llm.errored:
                raise EngineDead(f"the vLLM engine core died during {method}: {exc}") from exc
            raise
        return rank_zero_result(method, outcomes, llm.vllm_config.parallel_config.world_size)

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """Drop cached prefixes; running requests are preempted (recomputed) if they hold any.
        Nothing to do when no request reached the engine since the last reset."""
        llm = self._alive()
        if not self._gate.cache_stale:
            return
        if not await llm.reset_prefix_cache():
            await llm.reset_prefix_cache(reset_running_requests=True)
        if llm.model_config.is_multimodal_model:
            # image embeddings the old weights computed, in vLLM's scheduler and worker caches both
            # (without it, an image seen before a weight load killed the engine core on CPU with
            # "Encoder cache miss" when sent again after it)
            await llm.reset_encoder_cache()
        self._gate.cache_was_reset()


def _already_shut_down(timeout: float | None = None) -> None:
    """Stand-in for AsyncLLM.shutdown on an engine that was shut down."""


def _shutdown_late(future: asyncio.Future[Any], before: set[int]) -> None:
    """An engine whose start was cancelled (startup timeout): shut it down once it is up."""
    try:
        llm = future.result()
    except BaseException:
        llm = None
    if llm is not None:
        with contextlib.suppress(Exception):  # nothing is waiting for this engine any more
            llm.shutdown()
    processes.reap(processes.started_since(before), timeout_s=5.0)


if TYPE_CHECKING:
    from rlinfer_core.backend import FullBackend

    #: mypy checks the class against every operation hook of the typed boundary (names and
    #: signatures): the in-process backend implements them all
    _checked: type[FullBackend] = VllmBackend


__all__ = ["VllmBackend", "create"]
