"""The Engine facade: what a trainer uses. Async-first, with a thin sync wrapper.

    async with await AsyncEngine.open("vllm", EngineConfig(model=path)) as engine:
        completions = await engine.generate([GenerateRequest(prompt_token_ids=[1, 2, 3])])
        await engine.update_weights(NamedTensors.of(model.named_parameters()))

The facade owns everything that must not differ between backends: request and weight-update
validation, capability checks, the weight version, timeouts, prefix-cache reset after a weight
change, and event hooks for observer plugins. The backend object only drives its engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core import hookspecs
from rlinfer_core.agent import derive_capabilities
from rlinfer_core.backend import (
    BenchBackend,
    ProcessesBackend,
    check_backend,
    claimed_but_missing,
)
from rlinfer_core.discovery import BackendInfo, get_backend, plugin_objects
from rlinfer_core.engine_calls import BackendCalls
from rlinfer_core.engine_requests import Requests
from rlinfer_core.engine_staging import Staging
from rlinfer_core.engine_weights import Weights
from rlinfer_core.errors import BackendLoadError
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.observers import Observers
from rlinfer_core.oom_retry import OutOfMemoryRetry
from rlinfer_core.preflight import (
    TRANSPORT_CAPABILITY,
    as_memory_tags,
    request_capabilities,
    transport_capability,
    transport_name,
)
from rlinfer_core.types import (
    Capabilities,
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    MemoryTag,
    PauseMode,
)

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum, WeightVerification
    from rlinfer_core.lora import LoraAdapter, LoraInfo
    from rlinfer_core.scoring import Score, ScoreRequest
    from rlinfer_core.session import AsyncSession
    from rlinfer_core.staging import AsyncWeightStaging
    from rlinfer_core.tool_loop import ToolLoopConfig
    from rlinfer_core.tool_runner import Prompt, SamplingPolicy, ToolEpisode
    from rlinfer_core.tools import ToolCalls
    from rlinfer_core.types import SamplingParams
    from rlinfer_core.weights import BroadcastGroup, TensorSpec, WeightDelta, WeightSource, WeightUpdate


class AsyncEngine:
    """One running engine behind the rlinfer contract. Build it with :meth:`open`.

    This class states the whole surface and holds the lifecycle.
    Its components own the rest of its state: :class:`~rlinfer_core.engine_calls.BackendCalls`
    (the backend, optional hooks, deadlines, dead-engine detection),
    :class:`~rlinfer_core.engine_requests.Requests` (validation, admission, generate, stream,
    abort, pause, resume),
    :class:`~rlinfer_core.engine_weights.Weights` (version, updates, verification, memory) and
    :class:`~rlinfer_core.engine_staging.Staging` (the staged update now open).
    """

    def __init__(
        self,
        info: BackendInfo,
        backend: Any,
        config: EngineConfig,
        plugins: Sequence[Any] = (),
        entry_point_plugins: Sequence[Any] = (),
    ) -> None:
        self.backend_name = info.name
        self.config = config
        self._backend = check_backend(info.name, backend)
        # pluggy checks the backend's hookimpl signatures against the hookspecs at registration;
        # the facade then calls the typed methods. Observers live apart and cannot take them over.
        self._pm = hookspecs.PluginManager()
        self._pm.register(backend, name=f"backend:{info.name}")
        self._observers = Observers(plugins, entry_point_plugins)
        self.capabilities: Capabilities = derive_capabilities(self._backend.rlinfer_capabilities())
        self.model_info: ModelInfo | None = None
        self._calls = BackendCalls(info.name, self._backend, lambda: self.capabilities)
        self._weights = Weights(
            self._calls, lambda: self.config, self._observers, lambda: self.model_info, lambda: self._staging.open
        )
        self._staging = Staging(self._calls, lambda: self.config, self._observers, self._weights)
        self._requests = Requests(self, self._calls, self._weights, self._observers)

    # --- lifecycle -----------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        backend: str,
        config: EngineConfig | None = None,
        *,
        plugins: Sequence[Any] = (),
        load_entry_point_plugins: bool = True,
        oom_retry: OutOfMemoryRetry | None = None,
        **config_fields: Any,
    ) -> AsyncEngine:
        """Discover ``backend``, start its engine and return the facade.

        ``config`` or keyword fields of :class:`EngineConfig` (not both). Observer plugins from
        the ``rlinfer.plugins`` entry points are registered unless ``load_entry_point_plugins``
        is False; ``plugins`` adds more. ``oom_retry``: retry generate after a transient
        EngineOutOfMemory (:mod:`rlinfer_core.oom_retry`; off by default).
        """
        if config is None:
            config = EngineConfig(**config_fields)
        elif config_fields:
            config = attrs.evolve(config, **config_fields)
        info = get_backend(backend)
        extra = plugin_objects() if load_entry_point_plugins else []
        return await cls._open_backend(info, info.create(config), config, plugins, extra, oom_retry)

    @classmethod
    async def _open_backend(
        cls,
        info: BackendInfo,
        backend: Any,
        config: EngineConfig,
        plugins: Sequence[Any],
        entry_point_plugins: Sequence[Any],
        oom_retry: OutOfMemoryRetry | None = None,
    ) -> AsyncEngine:
        """Start ``backend`` (an object implementing the operation hooks, made for ``info``'s
        engine) behind the facade: :meth:`open` once it has built the backend, and packages that
        build their own backend object over an engine (``rlinfer_ray``'s pool of replicas)."""
        engine = cls(info, backend, config, plugins, entry_point_plugins)
        if oom_retry is not None:
            engine._requests.oom_retry = oom_retry
        if config.deterministic:  # refused before anything starts
            engine.capabilities.require(Capability.DETERMINISTIC)
        if config.enable_routed_experts:
            engine.capabilities.require(Capability.GENERATE_ROUTED_EXPERTS)
        if config.enable_hidden_states:
            engine.capabilities.require(Capability.GENERATE_HIDDEN_STATES)
        if config.priority_scheduling:
            engine.capabilities.require(Capability.PRIORITY)
        if config.engine_kwargs.get("quantization") is not None:  # both engines' name for it
            engine.capabilities.require(Capability.WEIGHTS_QUANTIZED_RELOAD)
        started = time.perf_counter()
        try:
            await engine._calls.with_timeout(engine._backend.rlinfer_start(config), config.startup_timeout_s, "start")
            engine.capabilities = derive_capabilities(engine._backend.rlinfer_capabilities())
            engine.model_info = engine._backend.rlinfer_model_info()
            dishonest = claimed_but_missing(engine._backend, engine.capabilities.supported)
            if dishonest:
                raise BackendLoadError(f"backend {info.name!r} claims capabilities without their hooks: {dishonest}")
        except BaseException:
            await engine._shutdown_quietly()
            raise
        engine._observers.emit(
            "rlinfer_on_engine_started",
            backend=info.name,
            capabilities=engine.capabilities,
            seconds=time.perf_counter() - started,
        )
        return engine

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop the engine and its processes. Safe to call twice."""
        if self._calls.closed:
            return
        self._calls.closed = True
        try:
            await self._calls.with_timeout(self._backend.rlinfer_shutdown(), 120.0, "shutdown")
        finally:
            self._observers.emit("rlinfer_on_engine_shutdown", backend=self.backend_name)

    async def _shutdown_quietly(self) -> None:
        with contextlib.suppress(Exception):  # best effort; the start error is what matters
            await self.shutdown()

    async def check_health(self) -> None:
        """Raise EngineDead if the engine can no longer serve."""
        self._calls.ensure_open()
        await self._calls.with_timeout(self._backend.rlinfer_check_health(), 30.0, "health check")

    # --- state ---------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """Version of the weights now served: 0 at start, +1 (or as requested) per update."""
        return self._weights.version

    @property
    def weight_specs(self) -> Mapping[str, TensorSpec]:
        """HF parameter names the engine accepts, with dtype and shape."""
        return self._weights.specs

    @property
    def released(self) -> frozenset[MemoryTag]:
        """Memory tags now released."""
        return frozenset(self._weights.released)

    @property
    def in_flight(self) -> frozenset[str]:
        """Request ids handed to generate/stream that have not returned yet."""
        return self._requests.admission.in_flight

    @property
    def weights_discarded(self) -> bool:
        """True between ``release_memory(discard_weights=True)`` and the next full update: the
        engine holds no valid weights and refuses generation (WeightsNotLoaded)."""
        return self._weights.discarded

    @property
    def verifies_updates(self) -> bool:
        """Whether every update is read back and compared (``EngineConfig.verify_updates`` on an
        engine with ``weights.checksum``)."""
        return self._weights.verifies_updates

    @property
    def broadcast_ranks(self) -> int:
        """How many ranks of a broadcast group this engine takes: one per engine rank
        (``EngineConfig.world_size``: tensor x data x pipeline parallel sizes); a backend over
        several engines (``rlinfer_ray``'s pool) states its own count as ``broadcast_ranks``."""
        return self._weights.broadcast_ranks

    # --- generate ------------------------------------------------------------------------------

    async def generate(self, requests: GenerateRequest | Sequence[GenerateRequest]) -> list[Completion]:
        """Generate completions: ``n`` per request, in request order, then sample index."""
        return await self._requests.generate(requests)

    async def generate_over_sampled(
        self, requests: GenerateRequest | Sequence[GenerateRequest], over_sample_rate: float
    ) -> list[Completion]:
        """:meth:`generate`, returning once ``ceil(over_sample_rate * len(requests))`` requests have
        finished: the others are aborted and come back with ``finish_reason="abort"`` and their
        partial tokens (see :mod:`rlinfer_core.over_sample`)."""
        from rlinfer_core.over_sample import generate_over_sampled

        return await generate_over_sampled(self, requests, over_sample_rate, self.capabilities, self._requests.validate)

    def stream(self, request: GenerateRequest) -> AsyncGenerator[CompletionDelta, None]:
        """Stream one request's deltas; they concatenate to the batch result.

        Checked like :meth:`generate` when called (capabilities, request limits), before any
        iteration; the whole stream is bounded by ``request_timeout_s`` (the request is aborted
        when it runs out) and an engine that died meanwhile raises EngineDead.
        """
        return self._requests.stream(request)

    async def abort(self, request_ids: Sequence[str] | str | None = None) -> None:
        """Abort requests (``None``: all in flight); their callers get partial tokens, "abort"."""
        await self._requests.abort(request_ids)

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation (see PauseMode for what happens to in-flight requests)."""
        await self._requests.pause(mode)

    async def resume(self) -> None:
        """Resume generation after :meth:`pause`."""
        await self._requests.resume()

    # --- weight sync (rlinfer_core.engine_weights, rlinfer_core.engine_staging) ------------------

    async def update_weights(
        self,
        update: WeightUpdate | WeightSource | WeightDelta | Mapping[str, Any],
        *,
        version: int | None = None,
    ) -> int:
        """Load new weights, all or nothing; return the new weight version.

        Accepts a WeightUpdate, a bare source, a ``{name: tensor}`` mapping, or a
        :class:`~rlinfer_core.weights.WeightDelta` (capability ``weights.delta``: loaded only when
        the engine serves its ``base_version``). Everything is validated against
        :attr:`weight_specs` before the engine is touched; on any failure WeightUpdateError is
        raised and the previous weights and version keep serving. After
        ``release_memory(discard_weights=True)`` only a full update (every name of
        :attr:`weight_specs`) is accepted.
        """
        return await self._weights.update(update, version)

    async def stage_weights(
        self, update: WeightUpdate | WeightSource | Mapping[str, Any], *, version: int | None = None
    ) -> AsyncWeightStaging:
        """Validate ``update`` and move it into the engine while generation goes on; return the
        handle to :meth:`~rlinfer_core.staging.AsyncWeightStaging.add` more buckets to,
        ``commit()`` or ``cancel()`` (see :mod:`rlinfer_core.staging` for the semantics).

        Takes what ``update_weights`` takes except a WeightDelta and a broadcast source. The
        version (``version``, else the live one + 1) is fixed now. WeightStagingError while
        another staging is open; StagingLimitExceeded over ``EngineConfig.max_staged_weight_bytes``.
        """
        return await self._staging.stage(update, version)

    @property
    def staged_weight_limit(self) -> int:
        """The most bytes a staging may hold: ``EngineConfig.max_staged_weight_bytes``, by
        default one full copy of the weights (:attr:`weight_specs`)."""
        return self._staging.limit

    async def init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have the engine join the trainer's broadcast group (trainer is rank 0).

        Call it concurrently with :class:`rlinfer_core.transfer.broadcast.WeightBroadcaster`
        construction on the trainer side: both block until the group is formed.
        """
        await self._weights.init_broadcast(group)

    async def weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums of every tensor the engine serves, computed inside the engine (HF names)."""
        return await self._weights.checksums()

    async def verify_weights(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> WeightVerification:
        """Compare what the engine serves with the trainer's ``tensors`` (bit for bit, in the dtype
        the engine holds). A tied output head is checked against the embedding it is tied to."""
        return await self._weights.verify(tensors)

    def checkpoint_names(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``tensors`` under the names of :attr:`weight_specs`: a transformers >= 5 model's fused
        experts become one view per expert and projection (nothing is copied). Named tensors and
        buckets are converted by :meth:`update_weights` itself; a checkpoint directory or a
        broadcast must carry these names."""
        return self._weights.checkpoint_names(tensors)

    # --- memory and cache ------------------------------------------------------------------------

    async def release_memory(
        self,
        tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None,
        *,
        discard_weights: bool = False,
    ) -> None:
        """Free accelerator memory for ``tags`` (default: all). Raises UnsupportedCapability where
        the platform cannot free it (e.g. CPU): never a silent no-op.

        ``discard_weights=True`` (capability ``memory.discard_weights``; ``tags`` must include
        weights) drops the weights without a host backup: faster, and no host memory used. After
        ``resume_memory(["weights"])`` the weights' memory is back but holds garbage, so
        generation is refused with WeightsNotLoaded until a full :meth:`update_weights` loads.
        The RL phase switch: release(discard) -> train -> resume(weights) -> update(full) ->
        resume(kv_cache) -> generate.
        """
        await self._weights.release_memory(tags, discard_weights)

    async def resume_memory(self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None) -> None:
        """Re-allocate memory released by :meth:`release_memory` (default: all tags)."""
        await self._weights.resume_memory(tags)

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (after every weight update the facade, or a backend that states
        ``update_invalidates_prefixes``, does what is needed itself)."""
        self._calls.ensure_open()
        self.capabilities.require(Capability.PREFIX_CACHE_RESET)
        await self._weights.reset_prefix_cache()

    def engine_processes(self) -> Mapping[str, int]:
        """The engine's child processes now running, ``{role: pid}``."""
        self._calls.ensure_open()
        return self._calls.optional(ProcessesBackend.rlinfer_engine_processes)()

    # --- benchmarking (Capability.BENCH; optional) ---------------------------------------------

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """Run ``requests`` through the engine's native API (no rlinfer conversion); tokens out."""
        self._calls.ensure_open()
        raw_generate = self._calls.optional(BenchBackend.rlinfer_bench_raw_generate)
        return await self._calls.with_timeout(
            raw_generate(list(requests)), self.config.request_timeout_s, "bench_raw_generate"
        )

    async def bench_raw_weight_update(self, path: str) -> None:
        """The engine's own reload from a safetensors directory and nothing else (bench baseline):
        no validation, no version bump, no prefix-cache reset (call :meth:`reset_prefix_cache`)."""
        self._calls.ensure_open()
        raw_update = self._calls.optional(BenchBackend.rlinfer_bench_raw_weight_update)
        await self._calls.with_timeout(raw_update(path), self.config.request_timeout_s, "bench_raw_weight_update")

    # --- agent rollouts: sessions, scoring, tool calls, LoRA --------------------------------------

    def session(
        self,
        messages: Sequence[Mapping[str, Any]] | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        tools: Any = None,
        tool_parser: str | None = None,
        sampling: SamplingParams | None = None,
        chat_template: bool = True,
        strict: bool = True,
        lora: str | None = None,
    ) -> AsyncSession:
        """Open a multi-turn session (capability ``sessions``; see :mod:`rlinfer_core.session`).

        ``messages`` start a chat session rendered with the model's chat template (``tools``
        fill its tool section); ``chat_template=False`` with ``prompt_token_ids`` starts a raw
        token session. ``tool_parser`` parses every model turn's tool calls; ``sampling`` is the
        default for model turns; ``strict`` raises TemplateContinuityError where the template is
        not incremental (otherwise the turn is flagged ``exact=False``).
        """
        from rlinfer_core.session import AsyncSession

        self._calls.ensure_open()
        return AsyncSession(
            self,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            tools=tools,
            tool_parser=tool_parser,
            sampling=sampling,
            chat_template=chat_template,
            strict=strict,
            lora=lora,
        )

    async def score(self, requests: ScoreRequest | Sequence[ScoreRequest]) -> list[Score]:
        """Teacher-forced logprobs of given tokens under the current weights (capability
        ``score``, raw mode; see :mod:`rlinfer_core.scoring`)."""
        from rlinfer_core.scoring import score

        return await score(self, requests)

    async def parse_tool_calls(self, text: str, parser: str, tools: Any = None) -> ToolCalls:
        """Tool calls in ``text`` by the engine's own ``parser`` (capability ``generate.tools``)."""
        from rlinfer_core.agent import parse_tool_calls

        return await parse_tool_calls(self, text, parser, tools)

    async def run_tool_loop(
        self,
        prompts: Sequence[Prompt],
        config: ToolLoopConfig,
        sampling: SamplingParams | SamplingPolicy | None = None,
    ) -> list[ToolEpisode]:
        """The multi-turn tool loop over a batch of prompts, one session each, concurrently
        (capability ``sessions``; ``generate.tools`` when ``config`` has tools). Returns per prompt
        the session's result and the tool events; see :mod:`rlinfer_core.tool_runner`."""
        from rlinfer_core.tool_runner import run_tool_loop

        return await run_tool_loop(self, prompts, config, sampling)

    async def load_lora(self, adapter: LoraAdapter) -> LoraInfo:
        """Load a LoRA adapter (capability ``lora``); requests use it with ``lora=adapter.name``."""
        from rlinfer_core.lora import registry

        return await registry(self).load(adapter)

    async def update_lora(self, adapter: LoraAdapter) -> LoraInfo:
        """Replace a loaded adapter's weights in place (same name, rank and target modules)."""
        from rlinfer_core.lora import registry

        return await registry(self).update(adapter)

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name``."""
        from rlinfer_core.lora import registry

        await registry(self).unload(name)

    async def list_loras(self) -> list[LoraInfo]:
        """The loaded adapters."""
        from rlinfer_core.lora import registry

        return await registry(self).list()


# the sync wrapper lives in its own module; importable from here as before
from rlinfer_core.sync_engine import Engine, open_engine  # noqa: E402

__all__ = [
    "TRANSPORT_CAPABILITY",
    "AsyncEngine",
    "Engine",
    "as_memory_tags",
    "open_engine",
    "request_capabilities",
    "transport_capability",
    "transport_name",
]
