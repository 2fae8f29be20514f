"""The vLLM backend: rlinfer's operation hooks for one vLLM engine, written once over a transport.

Every concern is written once for both flavours: in-flight tracking, abort, the prefix cache and
capabilities here; pause and load sequencing, weights, staging and memory tags in components the
hooks delegate to (:class:`~rlinfer_vllm.load_gate.LoadSequencing`,
:class:`~rlinfer_vllm.weights.WeightSync`, :class:`~rlinfer_vllm.staging.Staging`,
:class:`~rlinfer_vllm.memory.MemoryControl`). The transport (:mod:`rlinfer_vllm.transport`) makes
the engine calls: :class:`~rlinfer_vllm.transport.in_process.InProcessTransport` over vLLM's
``AsyncLLM``, or :class:`~rlinfer_vllm.transport.http.HttpTransport` over vLLM's own API server
(``mode="server"`` or ``server_url``). The factory is :func:`rlinfer_vllm.plugin.create`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlinfer_core.checksum import WeightChecksum
from rlinfer_core.errors import EngineDead
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.tools import ToolCalls, ToolSpec
from rlinfer_core.types import (
    Capabilities,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import BroadcastGroup, TensorSpec, WeightUpdate
from rlinfer_vllm.capabilities import installed_engine, installed_platform
from rlinfer_vllm.config import resolve_platform
from rlinfer_vllm.load_gate import LoadGate, LoadSequencing
from rlinfer_vllm.memory import MemoryControl
from rlinfer_vllm.staging import Staging
from rlinfer_vllm.weights import WeightSync

if TYPE_CHECKING:
    from rlinfer_vllm.transport import Transport

#: how long abort() keeps re-aborting requests that were not registered in vLLM yet
ABORT_SETTLE_S = 2.0


class VllmBackend:
    """Implements rlinfer's operation hooks for one vLLM engine, in process or over its server."""

    #: the facade skips its prefix-cache reset after an update: LoadSequencing.loading does what is needed
    update_invalidates_prefixes = True
    #: the facade leaves the values of CUDA tensors to WeightSync.prepare's packing
    checks_cuda_tensor_values = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config, installed_platform())
        found = installed_engine()
        self.engine_version = f"{found[0]} {found[1]}" if found else "not installed"
        self._inflight: set[str] = set()  #: request ids of this backend in the engine (the transports add, discard)
        self._gate = LoadGate()
        self.transport: Transport = _transport(config, self)  #: the engine calls of this backend's flavour
        self._caps = self.transport.capabilities
        self._closed = False
        self._specs: dict[str, TensorSpec] = {}
        self._info: ModelInfo | None = None
        self._sequencing = LoadSequencing(self._alive, self._gate, self.rlinfer_reset_prefix_cache)
        self._weights = WeightSync(config, self.platform, self._alive, self.rlinfer_capabilities, self._sequencing)
        self._staging = Staging(self._alive, self._weights, self._sequencing)
        self._memory = MemoryControl(self._alive, self.rlinfer_capabilities, self.rlinfer_reset_prefix_cache)

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Start the engine (or attach to its server), read the parameter specs and the model's facts."""
        facts = await self.transport.start()
        self._specs, self._info, self._caps = facts.specs, facts.info, facts.capabilities

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
        self.transport.check_alive()
        return self.transport

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        """Raise EngineDead when an engine process died, or the engine was shut down."""
        self._alive()
        await self.transport.check_health()

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
        """Shut the engine down and make sure every process it started is gone (an attached
        server keeps running)."""
        if self._closed:
            return
        self._closed = True
        await self._weights.close(lambda: self.transport.rpc("rlinfer_release_mapped"))
        await self.transport.shutdown()

    @hookimpl
    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes (``APIServer`` of a launched server,
        ``EngineCore``, ``Worker-0``...; others by their name); none for an attached server."""
        return self.transport.processes()

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
        ids = list(self._inflight) if request_ids is None else list(request_ids)
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
        await self._sequencing.pause(mode)

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """vLLM's resume."""
        await self._sequencing.resume()

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

    # --- weights, staging, memory ------------------------------------------------------------

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names and shapes; dtypes: the checkpoint's under
        ``dtype="auto"``, else the served dtype."""
        return dict(self._specs)

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the worker, which loads it all-or-nothing."""
        await self._weights.update(update)

    @hookimpl
    async def rlinfer_weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums computed in the worker over what its kernels serve (see rlinfer_vllm.worker.served)."""
        return await self._weights.checksums(self._info.tied_weights if self._info is not None else {})

    async def quantized_check(self) -> dict[str, Any]:
        """Not a hook (the GPU bench and the docs' recipe call it): :meth:`WeightSync.quantized_check`."""
        return await self._weights.quantized_check()

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have the worker join the trainer's group (returns once every rank joined)."""
        await self._weights.join_broadcast(group)

    @hookimpl
    async def rlinfer_stage_weights(self, staging_id: str, update: WeightUpdate) -> None:
        """Copy the (validated) part into the worker's staging; generation goes on."""
        await self._staging.stage(staging_id, update)

    @hookimpl
    async def rlinfer_commit_staged_weights(self, staging_id: str, version: int) -> None:
        """Load the staged tensors with no engine step overlapping; tokens after it are ``version``."""
        await self._staging.commit(staging_id, version)

    @hookimpl
    async def rlinfer_cancel_staged_weights(self, staging_id: str) -> None:
        """Drop the worker's staged tensors."""
        await self._staging.cancel(staging_id)

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """GPU: vLLM sleep mode (level 2 with ``discard_weights``: the weights are dropped, not
        offloaded). CPU: UnsupportedCapability (vLLM frees nothing there)."""
        await self._memory.release(tags, discard_weights)

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: vLLM wake_up for ``tags`` (and the KV cache released along with the weights)."""
        await self._memory.resume(tags)

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


__all__ = ["ABORT_SETTLE_S", "VllmBackend"]
