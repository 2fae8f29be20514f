"""The vLLM backend: rlinfer's operation hooks for one vLLM engine, written once over a transport.

Every concern is written here (or in the mixins :mod:`rlinfer_vllm.weights`,
:mod:`rlinfer_vllm.staging`, :mod:`rlinfer_vllm.memory`) once for both flavours: in-flight
tracking and abort, the pause gate, weight-load sequencing and version labels, memory tags,
capabilities. The transport (:mod:`rlinfer_vllm.transport`) makes the engine calls:
:class:`~rlinfer_vllm.transport.in_process.InProcessTransport` over vLLM's ``AsyncLLM``, or
:class:`~rlinfer_vllm.transport.http.HttpTransport` over vLLM's own API server (``mode="server"``
or ``server_url``). The factory is :func:`rlinfer_vllm.plugin.create`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

from rlinfer_core.errors import EngineDead
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.tools import ToolCalls, ToolSpec
from rlinfer_core.transfer.arena import engine_arena
from rlinfer_core.types import (
    Capabilities,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import TensorSpec
from rlinfer_vllm.capabilities import installed_engine, installed_platform
from rlinfer_vllm.config import resolve_platform
from rlinfer_vllm.load_gate import LoadGate
from rlinfer_vllm.memory import MemoryHooks
from rlinfer_vllm.staging import StagingHooks
from rlinfer_vllm.weights import WeightHooks

if TYPE_CHECKING:
    from rlinfer_vllm.transport import Transport

#: how long abort() keeps re-aborting requests that were not registered in vLLM yet
ABORT_SETTLE_S = 2.0


class InFlight:
    """Request ids of this backend in the engine (the transports add and discard them)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def add(self, request_id: str) -> None:
        """``request_id`` is on its way to the engine."""
        self.ids.add(request_id)

    def discard(self, request_id: str) -> None:
        """``request_id`` ended in the engine (or never reached it)."""
        self.ids.discard(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.ids


class VllmBackend(WeightHooks, StagingHooks, MemoryHooks):
    """Implements rlinfer's operation hooks for one vLLM engine, in process or over its server."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config, installed_platform())
        found = installed_engine()
        self.engine_version = f"{found[0]} {found[1]}" if found else "not installed"
        self._inflight = InFlight()
        self._gate = LoadGate()
        self._ipc_arena = engine_arena()
        self._transport: Transport = _transport(config, self)
        self._caps = self._transport.capabilities
        self._closed = False
        self._specs: dict[str, TensorSpec] = {}
        self._info: ModelInfo | None = None
        self._asleep: set[MemoryTag] = set()
        self._implicitly_asleep: set[MemoryTag] = set()
        #: held while pausing, resuming or loading weights; _user_pause: the caller's pause mode
        self._pause_lock = asyncio.Lock()
        self._user_pause: PauseMode | None = None
        self.start_seconds: float | None = None

    @property
    def transport(self) -> Transport:
        """The engine calls of this backend's flavour."""
        return self._transport

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Start the engine (or attach to its server), read the parameter specs and the model's facts."""
        started = time.perf_counter()
        facts = await self._transport.start()
        self._specs, self._info, self._caps = facts.specs, facts.info, facts.capabilities
        self.start_seconds = time.perf_counter() - started

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        """Capabilities on this platform and flavour (refined at start)."""
        return self._caps

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        """Vocabulary size, context length and EOS ids of the served model."""
        if self._info is None:
            raise EngineDead("the vLLM engine is not started")
        return self._info

    def _alive(self) -> Transport:
        if self._closed:
            raise EngineDead("the vLLM engine is shut down; open a new engine")
        self._transport.check_alive()
        return self._transport

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        """Raise EngineDead when an engine process died, or the engine was shut down."""
        self._alive()
        await self._transport.check_health()

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
        """Shut the engine down and make sure every process it started is gone (an attached
        server keeps running)."""
        if self._closed:
            return
        self._closed = True
        await self._ipc_arena.close(lambda: self._transport.rpc("rlinfer_release_mapped"))
        await self._transport.shutdown()

    @hookimpl
    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes (``APIServer`` of a launched server,
        ``EngineCore``, ``Worker-0``...; others by their name); none for an attached server."""
        return self._transport.processes()

    # --- generate, abort, pause ----------------------------------------------------------------

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Every request concurrently; n completions per request, in request order."""
        return await self._alive().generate(requests)

    @hookimpl
    async def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream deltas; the last one of each sample has its finish reason."""
        async for delta in self._alive().stream(request):
            yield delta

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request of this engine in flight); their callers get "abort"."""
        transport = self._alive()
        ids = list(self._inflight.ids) if request_ids is None else list(request_ids)
        self._gate.abort_waiting(ids)
        if not ids:
            return
        await transport.abort(ids)
        # A request whose call began but that vLLM has not registered yet ignores the abort;
        # abort again until every one of them has ended (bounded).
        deadline = time.monotonic() + ABORT_SETTLE_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            left = [i for i in ids if i in self._inflight]
            if not left:
                return
            await transport.abort(left)

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """vLLM's pause; "keep" also keeps the KV cache of the frozen requests."""
        transport = self._alive()
        async with self._pause_lock:
            await transport.pause(mode)
            self._user_pause = mode

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """vLLM's resume."""
        transport = self._alive()
        async with self._pause_lock:
            await transport.resume()
            self._user_pause = None

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """Drop cached prefixes; running requests are preempted (recomputed) if they hold any.
        Nothing to do when no request reached the engine since the last reset."""
        transport = self._alive()
        if transport.gated and not self._gate.cache_stale:
            return
        if not await transport.reset_prefix_cache(reset_running=False):
            await transport.reset_prefix_cache(reset_running=True)
        if transport.multimodal:
            # image embeddings the old weights computed, in vLLM's scheduler and worker caches both
            # (without it, an image seen before a weight load killed the engine core on CPU with
            # "Encoder cache miss" when sent again after it)
            await transport.reset_encoder_cache()
        self._gate.cache_was_reset()

    # --- what one flavour may lack (its capabilities say so; the facade's gate refuses first) ---

    @hookimpl
    def rlinfer_parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Tool calls in ``text`` by vLLM's own parser (:mod:`rlinfer_vllm.tools`)."""
        return self._alive().parse_tool_calls(text, parser, tools)

    @hookimpl
    async def rlinfer_load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        """Load ``adapter`` as a new vLLM adapter (``replace``: and switch its name to it)."""
        await self._alive().load_lora(adapter, replace)

    @hookimpl
    async def rlinfer_unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (its vLLM adapter goes once no request in flight uses it)."""
        await self._alive().unload_lora(name)

    @hookimpl
    async def rlinfer_list_loras(self) -> Sequence[str]:
        """Names of the adapters vLLM holds and rlinfer serves."""
        return await self._alive().list_loras()

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch through the engine's own API with hand-built parameters; tokens out."""
        return await self._alive().bench_raw_generate(requests)

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """vLLM's own reload from disk (``reload_weights(weights_path=...)``), no validation."""
        await self._alive().bench_raw_weight_update(path)


def _transport(config: EngineConfig, backend: VllmBackend) -> Transport:
    """The flavour ``config`` asks for: vLLM's server (``mode="server"`` / ``server_url``) or
    AsyncLLM in process."""
    if config.server_mode:
        from rlinfer_vllm.transport.http import HttpTransport

        return HttpTransport(config, backend.platform, backend.engine_version, backend._inflight)
    from rlinfer_vllm.transport.in_process import InProcessTransport

    return InProcessTransport(config, backend.platform, backend.engine_version, backend._inflight, backend._gate)


if TYPE_CHECKING:
    from rlinfer_core.backend import FullBackend

    #: mypy checks the class against every operation hook of the typed boundary (names and
    #: signatures); a flavour that lacks one leaves its capability off
    _checked: type[FullBackend] = VllmBackend


__all__ = ["ABORT_SETTLE_S", "InFlight", "VllmBackend"]
