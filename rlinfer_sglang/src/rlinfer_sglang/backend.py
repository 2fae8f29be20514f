"""The SGLang backend: rlinfer's operation hooks over one SGLang engine, written once.

Its hooks hand the work to a component per concern that owns its state, shared by both flavours:
admission and in-flight tracking (:mod:`~rlinfer_sglang.inflight`), generate and stream
(:mod:`~rlinfer_sglang.generation`, with :mod:`~rlinfer_sglang.requests` and
:mod:`~rlinfer_sglang.outputs`), abort, pause and memory (:mod:`~rlinfer_sglang.pausing`), weights
and the prefix cache (:mod:`~rlinfer_sglang.weights`), LoRA (:mod:`~rlinfer_sglang.lora`); tool
calls are :mod:`~rlinfer_sglang.agent`'s parser, and the bench baselines call the engine directly.
A transport (:mod:`rlinfer_sglang.transport`) makes the engine calls: SGLang's offline ``Engine``
in this process, or SGLang's HTTP server (``mode="server"`` / ``server_url``). The code that runs
inside SGLang's scheduler process is :mod:`rlinfer_sglang.scheduler`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlinfer_core.errors import EngineDead, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.types import Capabilities, EngineConfig
from rlinfer_sglang import agent
from rlinfer_sglang.capabilities import Platform, capabilities, installed_platform, installed_version, multimodal_off
from rlinfer_sglang.config import resolve_platform
from rlinfer_sglang.generation import Generation
from rlinfer_sglang.inflight import InFlight
from rlinfer_sglang.lora import LoraAdapters
from rlinfer_sglang.oom import kv_capacity_tokens
from rlinfer_sglang.pausing import Pausing
from rlinfer_sglang.transport import Served, Transport
from rlinfer_sglang.weights import Weights

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum
    from rlinfer_core.lora import LoraAdapter
    from rlinfer_core.tools import ToolCalls, ToolSpec
    from rlinfer_core.types import Completion, CompletionDelta, GenerateRequest, MemoryTag, PauseMode
    from rlinfer_core.weights import BroadcastGroup, TensorSpec, WeightUpdate


class SGLangBackend:
    """Implements rlinfer's operation hooks for one SGLang engine, over ``transport``."""

    #: the facade leaves the values of CUDA tensors to the packing of :meth:`Weights.update`
    checks_cuda_tensor_values = True

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
        flight = self._flight = InFlight(transport.alive)
        self._info: ModelInfo | None = None
        self._lora = LoraAdapters(transport)
        self._generation = Generation(config.model, transport, flight, self._lora, self.rlinfer_model_info)
        self._pausing = Pausing(transport, flight, self.rlinfer_capabilities, self.rlinfer_reset_prefix_cache)
        self._weights = Weights(config, self.platform, transport, flight, self._pausing, self.rlinfer_capabilities)

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Start the engine (or attach to its server) and read what it serves."""
        served = await self._transport.start(self._caps)
        self._info = self._model_info(served)
        self._weights.started(served)
        self._generation.started(served)
        self._caps = served.capabilities.without(multimodal_off(self.config.model))

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
        await self._weights.close()
        await self._transport.shutdown()
        self._lora.close()

    @hookimpl
    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes ("scheduler", "detokenizer", and a
        launched server's "server"); none for an attached server (not this engine's to manage)."""
        return self._transport.processes()

    def engine_processes(self) -> list[int]:
        """Pids of the processes the engine started that are still running."""
        return list(self._transport.processes().values())

    @hookimpl
    def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream deltas of every sample (SGLang streams cumulative outputs; deltas are cut here)."""
        return self._generation.stream(request)

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Send every sample to SGLang as one batch; n completions per request, in request order."""
        return await self._generation.generate(requests)

    @hookimpl
    def rlinfer_parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Tool calls in ``text`` by SGLang's own ``FunctionCallParser`` (see :mod:`rlinfer_sglang.agent`)."""
        return agent.parse(text, parser, tools)

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch in one native batched generate call with hand-built params."""
        from rlinfer_sglang.requests import bench_body

        self._transport.alive()
        body = bench_body(requests)
        if body is None:
            return 0
        self._flight.cache_dirty = True  # the baseline skips the admission gate, but fills the radix cache
        outs = await self._transport.raw_generate(body)
        return sum(len(o["output_ids"]) for o in outs)

    @hookimpl
    async def rlinfer_load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        """Load ``adapter`` as a new SGLang adapter (``replace``: and switch its name to it)."""
        await self._lora.load(adapter)

    @hookimpl
    async def rlinfer_unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (its SGLang adapter goes once no request in flight uses it)."""
        await self._lora.unload(name)

    @hookimpl
    async def rlinfer_list_loras(self) -> Sequence[str]:
        """Names of the adapters SGLang holds and rlinfer serves."""
        return self._lora.names()

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request in flight); their callers get "abort"."""
        await self._pausing.abort(request_ids)

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """abort -> SGLang "abort"; keep -> SGLang "retract"; wait -> rlinfer drains (see README)."""
        await self._pausing.pause(mode)

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """GPU: SGLang's memory saver. CPU: UnsupportedCapability (SGLang frees nothing there)."""
        await self._pausing.release_memory(tags, discard_weights)

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """Resume SGLang (if it was paused) and let held-back requests start."""
        await self._pausing.resume()

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: re-allocate what release freed (weights come back from the host backup)."""
        await self._pausing.resume_memory(tags)

    @property
    def update_invalidates_prefixes(self) -> bool:
        """The facade's question: where requests carry a per-version cache key, an update leaves
        no prefix of older weights reachable, so the facade does not reset the cache after it
        (which would wait for, or retract, the requests in flight)."""
        return self._transport.salts

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names, in the engine's dtype, with their shapes."""
        return dict(self._weights.specs)

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to SGLang's scheduler, which checks all of it, then loads."""
        await self._weights.update(update)

    @hookimpl
    async def rlinfer_weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums computed in the scheduler over the served parameters, by HF name."""
        return await self._weights.checksum()

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """Flush SGLang's cache; running requests are retracted (recomputed) if they hold any."""
        await self._weights.reset_prefix_cache()

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have every scheduler rank join the trainer's group (blocks until all ranks joined)."""
        await self._weights.join_broadcast(group)

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """SGLang's own ``update_weights_from_disk``, no rlinfer validation."""
        self._transport.alive()
        ok, message = await self._transport.update_from_disk(str(Path(path).resolve()))
        if not ok:
            raise WeightUpdateError(f"SGLang update_weights_from_disk failed: {message}")
        # the scheduler's own flush refuses while a just-finished request is still in its running
        # batch (a race right after generate): flushed through the same retrying reset
        self._flight.cache_dirty = True
        await self.rlinfer_reset_prefix_cache()


if TYPE_CHECKING:
    from typing import Protocol

    from rlinfer_core import backend as contract

    class _Implemented(
        contract.Backend,
        contract.StreamingBackend,
        contract.AbortingBackend,
        contract.PausingBackend,
        contract.BroadcastBackend,
        contract.ChecksumBackend,
        contract.MemoryBackend,
        contract.PrefixCacheBackend,
        contract.ProcessesBackend,
        contract.BenchBackend,
        contract.ToolsBackend,
        contract.LoraBackend,
        Protocol,
    ):
        """Every protocol of the typed boundary."""

    #: mypy checks the class against those operation hooks (names and signatures)
    _checked: type[_Implemented] = SGLangBackend


__all__ = ["SGLangBackend"]
