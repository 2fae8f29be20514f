"""The in-process transport: vLLM's ``AsyncLLM`` in the caller's process and event loop.

AsyncLLM runs the engine core (scheduler) and its workers in child processes. Weight updates
reach the workers through ``collective_rpc`` into
:class:`rlinfer_vllm.worker.RLInferWorkerExtension`. The transport owns the engine (its processes,
model facts and token versions) and builds the components that use it: generation
(:class:`rlinfer_vllm.generation.Generation`, with images), raw-logprob scoring
(:class:`rlinfer_vllm.raw.RawLogprobs`), LoRA adapters (:class:`rlinfer_vllm.lora.LoraAdapters`)
and ``rlinfer bench``'s raw baselines (:class:`rlinfer_vllm.bench.RawBaseline`). The backend's
concerns are in :class:`rlinfer_vllm.backend.VllmBackend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlinfer_core import processes
from rlinfer_core.errors import BackendLoadError, EngineDead, InvalidRequest, RLInferError, UnsupportedCapability
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.tools import ToolCalls, ToolSpec
from rlinfer_core.types import (
    Capabilities,
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    PauseMode,
)
from rlinfer_core.weights import TensorSpec
from rlinfer_vllm.bench import RawBaseline
from rlinfer_vllm.capabilities import PRIORITY_OFF_NOTE, Platform, capabilities, lora_refused
from rlinfer_vllm.config import engine_args, engine_environment
from rlinfer_vllm.generation import Generation
from rlinfer_vllm.lora import LoraAdapters
from rlinfer_vllm.raw import RawLogprobs
from rlinfer_vllm.tools import ToolParsing
from rlinfer_vllm.transport import ProcessWatch, Started, process_roles
from rlinfer_vllm.versions import TokenVersions

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlinfer_vllm.load_gate import LoadGate


logger = logging.getLogger("rlinfer_vllm.backend")

#: how long vLLM's own shutdown may take before rlinfer kills what is left of the engine
SHUTDOWN_TIMEOUT_S = 30.0
#: the grace vLLM's process manager gives its engine core before killing it, on CPU: there the
#: worker process never leaves its busy loop on the engine core's request nor on SIGTERM, so the
#: engine core waits for it until vLLM's default grace (5 s) ends and both are killed anyway
CPU_ENGINE_CORE_GRACE_S = 1.0

#: how much longer than the workers' own deadline a step-boundary load may take to answer
STEP_BOUNDARY_GRACE_S = 30.0

#: vLLM's structured-output settings unless engine_kwargs set them: xgrammar (what "auto" picks
#: for the constraints rlinfer sends) generating JSON without free whitespace, so that a model
#: cannot spend its token budget on it (any valid document is still reachable, compactly)
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


class InProcessTransport:
    """The engine calls over one ``AsyncLLM``."""

    gated = True

    def __init__(
        self, config: EngineConfig, platform: Platform, engine_version: str, inflight: set[str], gate: LoadGate
    ) -> None:
        self.config = config
        self.platform = platform
        self._gate = gate
        self.capabilities = capabilities(
            platform,
            engine_version,
            config.enable_memory_release if platform == "cuda" else None,
            inprocess=True,
            lora=bool(config.engine_kwargs.get("enable_lora", False)),
        )
        #: why this engine's configuration cannot serve the LoRA it asks for (refused at start)
        self._lora_refused = lora_refused(platform, config.dtype) if config.engine_kwargs.get("enable_lora") else None
        if self._lora_refused is not None:
            self.capabilities = self.capabilities.without({Capability.LORA: self._lora_refused})
        self._llm: AsyncLLM | None = None
        self._closed = False
        self._info: ModelInfo | None = None
        self._engine_procs: list[Any] = []
        self._versions: TokenVersions | None = None
        self._dead_processes = ProcessWatch(self._dead_now)
        self._tool_parsing: ToolParsing | None = None
        self._lora = LoraAdapters(self._alive)
        self._raw = RawLogprobs(self._alive, self._translate, gate, self._started_versions)
        self._generation = Generation(
            config.model,
            self._alive,
            self._translate,
            self._started_versions,
            self._max_len,
            inflight,
            gate,
            self._lora,
            self._raw,
        )
        self._baseline = RawBaseline(self._alive, gate, self.rpc)

    @property
    def kv_cache_release(self) -> bool:
        """Whether this vLLM releases the KV cache alone (0.32)."""
        return getattr(self._llm, "release_kv_cache_memory", None) is not None

    #: requests carry the salt of the version live when the load gate admits them
    salted = True
    #: weight loads run in the engine core between two steps (set at start: :func:`step_boundary_ready`)
    loads_at_step_boundary = False

    def prefill_pending(self) -> bool:
        """Whether a sample admitted into the engine has no token yet (the token counts are
        complete once the scheduler is paused, :mod:`rlinfer_vllm.versions`)."""
        return self._versions is not None and self._versions.unstarted and not self._gate.idle

    async def settle_prefills(self, timeout_s: float) -> None:
        """Wait (polling the token counts, which the engine's outputs update on this event loop)
        until every admitted sample has a token, or ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.prefill_pending() and asyncio.get_running_loop().time() < deadline:
            self.check_alive()
            await asyncio.sleep(0.001)

    @property
    def multimodal(self) -> bool:
        """Whether the served model takes images."""
        return self._llm is not None and bool(self._llm.model_config.is_multimodal_model)

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> Started:
        """Start AsyncLLM (engine core + worker processes), then build the worker's weight shadow."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._lora_refused is not None:  # the engine core would die at start
            raise UnsupportedCapability(Capability.LORA.value, "vllm", self._lora_refused)
        config = self.config
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
        rows = (await llm.collective_rpc("rlinfer_init", args=(config.dtype == "auto",)))[0]
        specs = {name: TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in rows}
        self._info = self._model_info(llm, specs)
        self.capabilities = self._runtime_capabilities(llm)
        self.loads_at_step_boundary = await step_boundary_ready(llm, config)
        return Started(specs, self._info, self.capabilities)

    def _model_info(self, llm: AsyncLLM, specs: Mapping[str, TensorSpec]) -> ModelInfo:
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
        if getattr(model_config.hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in specs:
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
        return self.capabilities.without(off)

    def check_alive(self) -> None:
        """EngineDead when the engine core or a worker died, or the engine was shut down."""
        self._alive()

    async def check_health(self) -> None:
        """Nothing beyond :meth:`check_alive` (AsyncLLM reports a dead core itself)."""

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

    def _started_versions(self) -> TokenVersions:
        assert self._versions is not None
        return self._versions

    def _max_len(self) -> int:
        assert self._info is not None
        return self._info.max_model_len

    def _dead_now(self) -> list[int]:
        """Pids of engine processes (engine core, workers) that are no longer running."""
        running = {p.pid for p in processes.alive(self._engine_procs)}
        return [p.pid for p in self._engine_procs if p.pid not in running]

    async def shutdown(self) -> None:
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
                    orderly = llm.shutdown
                    if self.platform == "cpu":
                        orderly = functools.partial(llm.shutdown, timeout=CPU_ENGINE_CORE_GRACE_S)
                    await asyncio.wait_for(loop.run_in_executor(None, orderly), SHUTDOWN_TIMEOUT_S)
                except TimeoutError:
                    logger.warning("vLLM's shutdown took over %.0f s; killing its processes", SHUTDOWN_TIMEOUT_S)
                    await loop.run_in_executor(None, processes.kill, self._engine_procs)
                # AsyncLLM.__del__ calls shutdown() again, possibly at interpreter exit when
                # vLLM's module globals are gone; it is done (or given up) already.
                llm.shutdown = _already_shut_down  # type: ignore[method-assign,unused-ignore]
            finally:
                await loop.run_in_executor(None, processes.reap, self._engine_procs)
                self._lora.close()

    def engine_processes(self) -> list[int]:
        """Pids of the processes the engine started that are still running."""
        return [p.pid for p in processes.alive(self._engine_procs)]

    def processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes, by vLLM's process titles."""
        return process_roles(processes.alive(self._engine_procs))

    def _translate(self, exc: Exception) -> Exception:
        import vllm.exceptions
        from vllm.v1.engine.exceptions import EngineDeadError

        # VLLMClientError exists from vLLM 0.27; VLLMValidationError is a ValueError before
        client_errors = (ValueError, getattr(vllm.exceptions, "VLLMClientError", ValueError))

        if isinstance(exc, RLInferError):
            return exc
        if isinstance(exc, EngineDeadError) or (self._llm is not None and self._llm.errored):
            return EngineDead(f"the vLLM engine core died: {exc}; open a new engine")
        self._dead_processes.look_now()  # the error may be the first sign
        gone = self._dead_processes()
        if gone:  # a dead worker surfaces as vLLM's EngineGenerateError before the core notices
            return EngineDead(f"vLLM engine process(es) {gone} died ({type(exc).__name__}: {exc}); open a new engine")
        if isinstance(exc, client_errors):
            return InvalidRequest("request", f"vLLM rejected it: {exc}")
        return exc

    # --- generation ----------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Run every request concurrently; n completions per request, in request order."""
        return await self._generation.generate(requests)

    def stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream deltas (vLLM's DELTA output kind); the last one of each sample has its finish reason."""
        return self._generation.stream(request)

    # --- abort, pause, caches ------------------------------------------------------------------

    async def abort(self, request_ids: Sequence[str]) -> None:
        """AsyncLLM.abort."""
        await self._alive().abort(list(request_ids))

    async def pause(self, mode: PauseMode) -> None:
        """vLLM's pause_generation once raw-logprob scorings finished; "keep" keeps the KV cache."""
        llm = self._alive()
        await self._raw.drain(self.config.request_timeout_s)  # raw-logprob prefills: short
        await llm.pause_generation(mode=mode.value, clear_cache=mode != PauseMode.KEEP)

    async def resume(self) -> None:
        """vLLM's resume_generation."""
        await self._alive().resume_generation()

    async def pause_for_load(self) -> None:
        """Pause the scheduler in "keep" mode (the engine core's call: AsyncLLM's adds a 20 ms sleep)."""
        llm = self._alive()
        pause = getattr(llm.engine_core, "pause_scheduler_async", None)
        if pause is not None:
            await pause(mode="keep", clear_cache=False)
        else:
            await llm.pause_generation(mode="keep", clear_cache=False)

    async def resume_after_load(self) -> None:
        """Resume unless the engine died meanwhile."""
        llm = self._llm
        if llm is not None and not llm.errored:
            await llm.resume_generation()

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        """AsyncLLM.reset_prefix_cache; whether it succeeded."""
        return bool(await self._alive().reset_prefix_cache(reset_running_requests=reset_running))

    async def reset_encoder_cache(self) -> None:
        """AsyncLLM.reset_encoder_cache."""
        await self._alive().reset_encoder_cache()

    # --- weights and memory --------------------------------------------------------------------

    async def rpc(self, method: str, *args: Any) -> Any:
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

    async def rpc_at_step_boundary(self, method: str, *args: Any, version: int) -> Any:
        """:meth:`rpc` run by the engine core between two engine steps, caches handled there
        (:mod:`rlinfer_vllm.engine_core.step_boundary`); the outputs of every later step are
        ``version`` if every rank loaded."""
        from rlinfer_vllm.engine_core.step_boundary import UTILITY
        from rlinfer_vllm.ranks import rank_zero_result

        llm = self._alive()
        core, versions = llm.engine_core, self._versions
        assert versions is not None
        before = set(core.utility_results)
        timeout_s = self.config.request_timeout_s
        call = asyncio.ensure_future(core.call_utility_async(UTILITY, method, list(args), timeout_s, self.multimodal))
        await asyncio.sleep(0)  # the call has registered the future its reply resolves
        replies = [core.utility_results[k] for k in core.utility_results.keys() - before]
        exact = len(replies) == 1
        if exact:
            versions.switch_on(replies[0], version, lambda reply: bool(reply["loaded"]))
        try:
            reply = await asyncio.wait_for(call, timeout_s + STEP_BOUNDARY_GRACE_S)
        except Exception as exc:
            if llm.errored:
                raise EngineDead(f"the vLLM engine core died during {method}: {exc}") from exc
            raise
        finally:
            versions.settle_switch()
        if not exact and reply["loaded"]:
            # another utility call was registered in the same tick: the switch is late by the
            # outputs that arrived meanwhile
            logger.warning("weight version %d labelled after the load's reply, not at it", version)
            versions.version = version
        reset = float(reply["prefix_cache_reset"])
        logger.debug("step-boundary load: %s", {**reply["timings"], "prefix_cache_reset": reset})
        return rank_zero_result(method, reply["outcomes"], llm.vllm_config.parallel_config.world_size)

    async def label_version(self, version: int) -> None:
        """Outputs of every later engine step are counted as ``version`` (:mod:`rlinfer_vllm.versions`)."""
        assert self._versions is not None
        self._versions.version = version

    async def sleep(self, level: int) -> None:
        """vLLM sleep mode (requests in flight are aborted)."""
        await self._alive().sleep(level=level, mode="abort")

    async def release_kv_cache(self) -> None:
        """Abort what runs and release the KV cache alone (vLLM 0.32)."""
        llm = self._alive()
        await llm.pause_generation(mode="abort")
        await llm.release_kv_cache_memory()  # type: ignore[attr-defined,unused-ignore]

    async def wake_up(self, tags: Sequence[str]) -> None:
        """vLLM wake_up for ``tags``."""
        await self._alive().wake_up(tags=list(tags))

    # --- tools, LoRA, bench --------------------------------------------------------------------

    def parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Tool calls in ``text`` by vLLM's own parser (:mod:`rlinfer_vllm.tools`)."""
        if self._tool_parsing is None:
            self._tool_parsing = ToolParsing(self._alive().tokenizer)
        return self._tool_parsing.parse(text, parser, tools)

    async def load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        """Load ``adapter`` as a new vLLM adapter (``replace``: and switch its name to it)."""
        await self._lora.load(adapter, replace)

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (its vLLM adapter goes once no request in flight uses it)."""
        await self._lora.unload(name)

    async def list_loras(self) -> Sequence[str]:
        """Names of the adapters vLLM holds and rlinfer serves."""
        return await self._lora.names()

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch through AsyncLLM.generate with hand-built vLLM params; tokens out."""
        return await self._baseline.generate(requests)

    async def bench_raw_weight_update(self, path: str) -> None:
        """vLLM's own reload from disk (``reload_weights(weights_path=...)``), no validation."""
        await self._baseline.weight_update(path)


async def step_boundary_ready(llm: AsyncLLM, config: EngineConfig) -> bool:
    """Whether weight loads can run at the engine core's step boundary: rlinfer's engine-core
    plugin answers, one engine core (no data parallelism), and ``RLINFER_VLLM_STEP_BOUNDARY`` is
    not ``0`` (then loads pause and resume the scheduler from here)."""
    from rlinfer_vllm.engine_core.step_boundary import READY

    if os.environ.get("RLINFER_VLLM_STEP_BOUNDARY", "1") == "0" or config.data_parallel_size != 1:
        return False
    try:
        return bool(await asyncio.wait_for(llm.engine_core.call_utility_async(READY), 30.0))
    except Exception as exc:  # the plugin is not installed, or VLLM_PLUGINS leaves it out
        logger.info("weight loads pause the scheduler: rlinfer's engine-core plugin did not answer (%s)", exc)
        return False


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


__all__ = ["InProcessTransport"]
