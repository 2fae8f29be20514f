"""The Engine facade: what a trainer uses. Async-first, with a thin sync wrapper.

    async with await AsyncEngine.open("vllm", EngineConfig(model=path)) as engine:
        completions = await engine.generate([GenerateRequest(prompt_token_ids=[1, 2, 3])])
        await engine.update_weights(NamedTensors.of(model.named_parameters()))

The facade owns everything that must not differ between backends: request and weight-update
validation, capability checks, the weight version, timeouts, prefix-cache reset after a weight
change, and event hooks for observer plugins. The backend object only drives its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import attrs

from rlinfer_core.agent import attach_tool_calls, derive_capabilities
from rlinfer_core.backend import AbortingBackend, PausingBackend, StreamingBackend, claimed_but_missing
from rlinfer_core.discovery import BackendInfo, get_backend, plugin_objects
from rlinfer_core.engine_agent import EngineAgent
from rlinfer_core.engine_staging import EngineStaging
from rlinfer_core.errors import BackendLoadError, InvalidRequest
from rlinfer_core.oom_retry import OutOfMemoryRetry, retrying_out_of_memory
from rlinfer_core.preflight import (
    TRANSPORT_CAPABILITY,
    as_batch,
    as_memory_tags,
    request_capabilities,
    transport_capability,
    transport_name,
)
from rlinfer_core.preflight import pause_mode as preflight_pause_mode
from rlinfer_core.types import (
    PAUSE_CAPABILITY,
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    FinishReason,
    GenerateRequest,
    PauseMode,
)

#: how long abort() keeps aborting targets the engine may not have registered yet
ABORT_SETTLE_S = 2.0


class AsyncEngine(EngineAgent, EngineStaging):
    """One running engine behind the rlinfer contract. Build it with :meth:`open`.

    Its parts: :class:`~rlinfer_core.engine_base.EngineBase` (state, timeouts),
    :class:`~rlinfer_core.engine_weights.EngineWeights` (weights, memory, bench),
    :class:`~rlinfer_core.engine_staging.EngineStaging` (staged weight updates); this class holds
    the lifecycle, generation and pause.
    """

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
            engine._oom_retry = oom_retry
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
        engine._discarded = config.load_format == "dummy"  # random weights: generate waits for an update
        started = time.perf_counter()
        try:
            await engine._with_timeout(engine._backend.rlinfer_start(config), config.startup_timeout_s, "start")
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
        if self._closed:
            return
        self._closed = True
        try:
            await self._with_timeout(self._backend.rlinfer_shutdown(), 120.0, "shutdown")
        finally:
            self._observers.emit("rlinfer_on_engine_shutdown", backend=self.backend_name)

    async def _shutdown_quietly(self) -> None:
        with contextlib.suppress(Exception):  # best effort; the start error is what matters
            await self.shutdown()

    async def check_health(self) -> None:
        """Raise EngineDead if the engine can no longer serve."""
        self._ensure_open()
        await self._with_timeout(self._backend.rlinfer_check_health(), 30.0, "health check")

    # --- generate ------------------------------------------------------------------------------

    async def generate(self, requests: GenerateRequest | Sequence[GenerateRequest]) -> list[Completion]:
        """Generate completions: ``n`` per request, in request order, then sample index."""
        batch = as_batch(requests, self._validate_request)
        if not batch:
            return []
        started = time.perf_counter()
        ids = [r.request_id for r in batch]
        async with self._admission.admit(ids, self.config.request_timeout_s) as ticket:
            if ticket.aborted:  # aborted while waiting at the pause gate: the engine never saw it
                completions = [aborted_at_gate(r, i) for r in batch for i in range(r.sampling.n)]
            else:
                completions = await retrying_out_of_memory(
                    lambda: self._engine_call(
                        lambda: self._backend.rlinfer_generate(batch),
                        self.config.request_timeout_s,
                        "generate",
                        on_timeout=lambda: self._abort_quietly(ids),
                    ),
                    self._oom_retry,
                )
        stamped = await attach_tool_calls(self, batch, [self._stamp(c) for c in completions])
        self._observers.emit(
            "rlinfer_on_generate_done",
            backend=self.backend_name,
            requests=batch,
            completions=stamped,
            seconds=time.perf_counter() - started,
        )
        return stamped

    async def generate_over_sampled(
        self, requests: GenerateRequest | Sequence[GenerateRequest], over_sample_rate: float
    ) -> list[Completion]:
        """:meth:`generate`, returning once ``ceil(over_sample_rate * len(requests))`` requests have
        finished: the others are aborted and come back with ``finish_reason="abort"`` and their
        partial tokens (see :mod:`rlinfer_core.over_sample`)."""
        from rlinfer_core.over_sample import generate_over_sampled

        return await generate_over_sampled(self, requests, over_sample_rate, self.capabilities, self._validate_request)

    def _stamp(self, completion: Completion) -> Completion:
        """Fill ``token_versions`` where a backend left them out (exact when no update overlapped
        the request) and set ``weight_version`` to the newest token's version."""
        versions = completion.token_versions
        if versions is None:
            versions = (self._version,) * len(completion.token_ids)
        newest = max(versions) if versions else self._version
        return attrs.evolve(completion, token_versions=tuple(versions), weight_version=newest)

    def stream(self, request: GenerateRequest) -> AsyncGenerator[CompletionDelta, None]:
        """Stream one request's deltas; they concatenate to the batch result.

        Checked like :meth:`generate` when called (capabilities, request limits), before any
        iteration; the whole stream is bounded by ``request_timeout_s`` (the request is aborted
        when it runs out) and an engine that died meanwhile raises EngineDead.
        """
        generate_stream = self._optional(StreamingBackend.rlinfer_generate_stream)
        if request.sampling.return_routed_experts:  # deltas carry no routes
            raise InvalidRequest("return_routed_experts", "routes come with generate(), not with stream()")
        if request.sampling.return_hidden_states:  # nor hidden states
            raise InvalidRequest("return_hidden_states", "hidden states come with generate(), not with stream()")
        self._validate_request(request)
        return self._stream(generate_stream, request)

    async def _stream(
        self, generate_stream: Callable[[GenerateRequest], AsyncIterator[CompletionDelta]], request: GenerateRequest
    ) -> AsyncGenerator[CompletionDelta, None]:
        ids = [request.request_id]
        deadline = time.monotonic() + self.config.request_timeout_s
        async with self._admission.admit(ids, self.config.request_timeout_s) as ticket:
            if ticket.aborted:
                for index in range(request.sampling.n):
                    c = aborted_at_gate(request, index)
                    yield CompletionDelta(c.request_id, index, (), (), FinishReason.ABORT, None, self._version, ())
                return
            iterator = generate_stream(request)
            try:
                while True:
                    try:
                        delta = await self._engine_call(
                            lambda: anext(iterator),
                            max(deadline - time.monotonic(), 0.001),
                            f"stream of {request.request_id!r}",
                            on_timeout=lambda: self._abort_quietly(ids),
                        )
                    except StopAsyncIteration:
                        return
                    versions = delta.token_versions
                    if versions is None:
                        versions = (self._version,) * len(delta.token_ids)
                    yield attrs.evolve(
                        delta, token_versions=tuple(versions), weight_version=max(versions, default=self._version)
                    )
            finally:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    await aclose()

    async def abort(self, request_ids: Sequence[str] | str | None = None) -> None:
        """Abort requests (``None``: all in flight); their callers get partial tokens, "abort"."""
        self._ensure_open()
        abort = self._optional(AbortingBackend.rlinfer_abort, Capability.ABORT)
        ids = [request_ids] if isinstance(request_ids, str) else (None if request_ids is None else list(request_ids))
        targets = sorted(self._admission.in_flight) if ids is None else ids
        self._admission.abort_waiting(ids)
        await self._with_timeout(abort(ids), 60.0, "abort")
        # A request accepted here may not be registered in the engine yet (it ignores an unknown
        # id, and "all" means all it knows): abort again until each target has ended, bounded.
        deadline = time.monotonic() + ABORT_SETTLE_S
        while (left := [i for i in targets if i in self._admission.in_flight]) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            await self._with_timeout(abort(left), 60.0, "abort")

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation (see PauseMode for what happens to in-flight requests)."""
        self._ensure_open()
        pause_mode = preflight_pause_mode(mode, self.capabilities)
        pause = self._optional(PausingBackend.rlinfer_pause, PAUSE_CAPABILITY[pause_mode])
        # Every request handed to generate/stream before this call is covered by the mode, even
        # one the engine has not registered yet: new ones wait at the gate until resume().
        self._admission.close_gate()
        try:
            if pause_mode is PauseMode.WAIT:
                await self._with_timeout(self._admission.drained(), self.config.request_timeout_s, "pause(wait)")
            await self._with_timeout(pause(pause_mode), self.config.request_timeout_s, "pause")
            if pause_mode is PauseMode.ABORT and self._admission.in_flight:
                abort = self._optional(AbortingBackend.rlinfer_abort, Capability.PAUSE_ABORT)
                await self._with_timeout(abort(sorted(self._admission.in_flight)), 60.0, "pause(abort)")
        except BaseException:
            self._admission.open_gate()
            raise

    async def resume(self) -> None:
        """Resume generation after :meth:`pause`."""
        self._ensure_open()
        try:
            resume = self._implemented(PausingBackend.rlinfer_resume)
            if resume is not None:
                await self._with_timeout(resume(), 60.0, "resume")
        finally:
            self._admission.open_gate()


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


def aborted_at_gate(request: GenerateRequest, index: int) -> Completion:
    """The completion of a request aborted before the engine saw it: no tokens, "abort"."""
    return Completion(
        request_id=request.request_id,
        index=index,
        prompt_token_ids=request.prompt_token_ids or (),
        token_ids=(),
        logprobs=(),
        finish_reason=FinishReason.ABORT,
        token_versions=(),
    )
