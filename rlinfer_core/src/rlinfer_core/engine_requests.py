"""The facade's request path: validation, admission at the pause gate, generate and stream with
their deadlines and version stamps, abort, pause and resume."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import attrs

from rlinfer_core.admission import Admission
from rlinfer_core.agent import attach_tool_calls, check_agent_request
from rlinfer_core.backend import AbortingBackend, PausingBackend, StreamingBackend
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.oom_retry import OutOfMemoryRetry, retrying_out_of_memory
from rlinfer_core.preflight import as_batch, check_config_limits, validate_request
from rlinfer_core.preflight import pause_mode as preflight_pause_mode
from rlinfer_core.types import (
    PAUSE_CAPABILITY,
    Capability,
    Completion,
    CompletionDelta,
    FinishReason,
    GenerateRequest,
    PauseMode,
)

if TYPE_CHECKING:
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_core.engine_calls import BackendCalls
    from rlinfer_core.engine_weights import Weights
    from rlinfer_core.observers import Observers

#: how long abort() keeps aborting targets the engine may not have registered yet
ABORT_SETTLE_S = 2.0

Stamped = TypeVar("Stamped", Completion, CompletionDelta)


class Requests:
    """Requests of one engine from the facade's call to their result.

    ``facade`` gives the configuration, capabilities and model info of now, and is what the
    agent helpers (tool-call parsing, adapter checks) take.
    """

    def __init__(self, facade: AsyncEngine, calls: BackendCalls, weights: Weights, observers: Observers) -> None:
        self._facade = facade
        self._calls = calls
        self._weights = weights
        self._observers = observers
        #: requests in flight and the pause gate
        self.admission = Admission()
        #: retry generate after a transient EngineOutOfMemory (off unless ``open(oom_retry=...)``)
        self.oom_retry = OutOfMemoryRetry()

    def validate(self, request: GenerateRequest) -> None:
        """Everything checked before a request reaches the engine; InvalidRequest or
        UnsupportedCapability, EngineDead after shutdown, WeightsNotLoaded after a discard."""
        facade = self._facade
        self._calls.ensure_open()
        validate_request(request, facade.capabilities, self._weights.released, facade.model_info)
        check_config_limits(request, facade.config)
        check_agent_request(facade, request)  # tools, structured, lora (rlinfer_core.agent)
        self._weights.require_loaded()

    async def generate(self, requests: GenerateRequest | Sequence[GenerateRequest]) -> list[Completion]:
        """:meth:`AsyncEngine.generate`."""
        batch = as_batch(requests, self.validate)
        if not batch:
            return []
        timeout_s = self._facade.config.request_timeout_s
        started = time.perf_counter()
        ids = [r.request_id for r in batch]
        backend = self._calls.backend
        async with self.admission.admit(ids, timeout_s) as ticket:
            if ticket.aborted:  # aborted while waiting at the pause gate: the engine never saw it
                completions = [aborted_at_gate(r, i) for r in batch for i in range(r.sampling.n)]
            else:
                completions = await retrying_out_of_memory(
                    lambda: self._calls.engine_call(
                        lambda: backend.rlinfer_generate(batch),
                        timeout_s,
                        "generate",
                        on_timeout=lambda: self._calls.abort_quietly(ids),
                    ),
                    self.oom_retry,
                )
        stamped = await attach_tool_calls(self._facade, batch, [self.stamp(c) for c in completions])
        self._observers.emit(
            "rlinfer_on_generate_done",
            backend=self._calls.name,
            requests=batch,
            completions=stamped,
            seconds=time.perf_counter() - started,
        )
        return stamped

    def stamp(self, result: Stamped) -> Stamped:
        """Fill a completion's or delta's ``token_versions`` where a backend left them out (exact
        when no update overlapped the request) and set ``weight_version`` to the newest token's."""
        versions = result.token_versions
        if versions is None:
            versions = (self._weights.version,) * len(result.token_ids)
        newest = max(versions, default=self._weights.version)
        return attrs.evolve(result, token_versions=tuple(versions), weight_version=newest)

    def stream(self, request: GenerateRequest) -> AsyncGenerator[CompletionDelta, None]:
        """:meth:`AsyncEngine.stream`: checked now, before any iteration."""
        generate_stream = self._calls.optional(StreamingBackend.rlinfer_generate_stream)
        if request.sampling.return_routed_experts:  # deltas carry no routes
            raise InvalidRequest("return_routed_experts", "routes come with generate(), not with stream()")
        if request.sampling.return_hidden_states:  # nor hidden states
            raise InvalidRequest("return_hidden_states", "hidden states come with generate(), not with stream()")
        self.validate(request)
        return self._stream(generate_stream, request)

    async def _stream(
        self, generate_stream: Callable[[GenerateRequest], AsyncIterator[CompletionDelta]], request: GenerateRequest
    ) -> AsyncGenerator[CompletionDelta, None]:
        ids = [request.request_id]
        timeout_s = self._facade.config.request_timeout_s
        deadline = time.monotonic() + timeout_s
        async with self.admission.admit(ids, timeout_s) as ticket:
            if ticket.aborted:
                for index in range(request.sampling.n):
                    c = aborted_at_gate(request, index)
                    yield CompletionDelta(
                        c.request_id, index, (), (), FinishReason.ABORT, None, self._weights.version, ()
                    )
                return
            iterator = generate_stream(request)
            try:
                while True:
                    try:
                        delta = await self._calls.engine_call(
                            lambda: anext(iterator),
                            max(deadline - time.monotonic(), 0.001),
                            f"stream of {request.request_id!r}",
                            on_timeout=lambda: self._calls.abort_quietly(ids),
                        )
                    except StopAsyncIteration:
                        return
                    yield self.stamp(delta)
            finally:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    await aclose()

    async def abort(self, request_ids: Sequence[str] | str | None) -> None:
        """:meth:`AsyncEngine.abort`."""
        self._calls.ensure_open()
        abort = self._calls.optional(AbortingBackend.rlinfer_abort, Capability.ABORT)
        ids = [request_ids] if isinstance(request_ids, str) else (None if request_ids is None else list(request_ids))
        targets = sorted(self.admission.in_flight) if ids is None else ids
        self.admission.abort_waiting(ids)
        await self._calls.with_timeout(abort(ids), 60.0, "abort")
        # A request accepted here may not be registered in the engine yet (it ignores an unknown
        # id, and "all" means all it knows): abort again until each target has ended, bounded.
        deadline = time.monotonic() + ABORT_SETTLE_S
        while (left := [i for i in targets if i in self.admission.in_flight]) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            await self._calls.with_timeout(abort(left), 60.0, "abort")

    async def pause(self, mode: PauseMode | str) -> None:
        """:meth:`AsyncEngine.pause`."""
        self._calls.ensure_open()
        timeout_s = self._facade.config.request_timeout_s
        pause_mode = preflight_pause_mode(mode, self._facade.capabilities)
        pause = self._calls.optional(PausingBackend.rlinfer_pause, PAUSE_CAPABILITY[pause_mode])
        # Every request handed to generate/stream before this call is covered by the mode, even
        # one the engine has not registered yet: new ones wait at the gate until resume().
        self.admission.close_gate()
        try:
            if pause_mode is PauseMode.WAIT:
                await self._calls.with_timeout(self.admission.drained(), timeout_s, "pause(wait)")
            await self._calls.with_timeout(pause(pause_mode), timeout_s, "pause")
            if pause_mode is PauseMode.ABORT and self.admission.in_flight:
                abort = self._calls.optional(AbortingBackend.rlinfer_abort, Capability.PAUSE_ABORT)
                await self._calls.with_timeout(abort(sorted(self.admission.in_flight)), 60.0, "pause(abort)")
        except BaseException:
            self.admission.open_gate()
            raise

    async def resume(self) -> None:
        """:meth:`AsyncEngine.resume`."""
        self._calls.ensure_open()
        try:
            resume = self._calls.implemented(PausingBackend.rlinfer_resume)
            if resume is not None:
                await self._calls.with_timeout(resume(), 60.0, "resume")
        finally:
            self.admission.open_gate()


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
