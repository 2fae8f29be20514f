"""TEST-ONLY double of a backend, for the Engine facade's unit tests. Not an engine.

``RecordingDoubleBackend`` implements the operation hooks in pure Python with deterministic fake
outputs and records every call, so the tests can check what the facade does *around* a backend
(validation, capability checks, versions, timeouts, events). It is never used to prove a real
backend: the conformance kit runs real engines only.

It is configured through ``EngineConfig.engine_kwargs``:
``supported`` (capability values), ``generate_delay_s``, ``fail_update`` (raise while loading),
``without`` (hook names the double pretends not to implement).
Its tool-call parser is a pure-Python hermes parser; its LoRA hooks keep adapters in a dict.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from rlinfer_core import hookimpl
from rlinfer_core.discovery import BackendInfo
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.tools import ToolCall, ToolCalls, ToolSpec
from rlinfer_core.types import (
    Capabilities,
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    FinishReason,
    GenerateRequest,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import BroadcastGroup, TensorSpec, WeightUpdate

VOCAB = 100
MAX_LEN = 32
SPECS = {
    "w": TensorSpec("w", "float32", (2, 2)),
    "b": TensorSpec("b", "float32", (2,)),
}
DEFAULT_SUPPORTED = frozenset(Capability) - {
    Capability.MEMORY_RELEASE,
    Capability.MEMORY_DISCARD_WEIGHTS,
    Capability.MEMORY_CUDA_GRAPH,
    Capability.CHAT,
    Capability.WEIGHTS_CHECKSUM,
}

#: every double built by the factory, newest last (tests read the one their engine uses)
INSTANCES: list[RecordingDoubleBackend] = []


class RecordingDoubleBackend:
    """Pure-Python stand-in for a backend: deterministic outputs, every call recorded."""

    def __init__(self, config: EngineConfig | None = None, **options: Any) -> None:
        kwargs = {**(dict(config.engine_kwargs) if config is not None else {}), **options}
        self.supported = frozenset(Capability(c) for c in kwargs.get("supported", DEFAULT_SUPPORTED))
        self.generate_delay_s = float(kwargs.get("generate_delay_s", 0.0))
        self.fail_update = bool(kwargs.get("fail_update", False))
        self.fail_stage = bool(kwargs.get("fail_stage", False))
        #: staging id -> the updates staged under it (what a real engine would hold)
        self.staged: dict[str, list[WeightUpdate]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.started = False
        self.adapters: dict[str, LoraAdapter] = {}
        INSTANCES.append(self)

    def names(self) -> list[str]:
        """Names of the hooks called so far, in order."""
        return [name for name, _ in self.calls]

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        self.calls.append(("start", config))
        self.started = True

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        notes = {"memory.release": "the double holds no memory", "memory.discard_weights": "no memory to discard"}
        return Capabilities("double", "0.0", "cpu", self.supported, notes)

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        return ModelInfo(VOCAB, MAX_LEN, (0,))

    @hookimpl
    def rlinfer_weight_specs(self) -> dict[str, TensorSpec]:
        return dict(SPECS)

    def _tokens(self, request: GenerateRequest, index: int) -> tuple[int, ...]:
        base = sum(request.prompt_token_ids or (7,)) + index
        return tuple((base + i) % VOCAB for i in range(request.sampling.max_tokens))

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        self.calls.append(("generate", [r.request_id for r in requests]))
        if self.generate_delay_s:
            await asyncio.sleep(self.generate_delay_s)
        out = []
        for r in requests:
            for index in range(r.sampling.n):
                tokens = self._tokens(r, index)
                out.append(
                    Completion(
                        request_id=r.request_id,
                        index=index,
                        prompt_token_ids=r.prompt_token_ids or (),
                        token_ids=tokens,
                        logprobs=tuple(-0.5 for _ in tokens),
                        finish_reason=FinishReason.LENGTH,
                    )
                )
        return out

    @hookimpl
    async def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        self.calls.append(("stream", request.request_id))
        tokens = self._tokens(request, 0)
        for i, token in enumerate(tokens):
            if self.generate_delay_s:
                await asyncio.sleep(self.generate_delay_s)
            last = i == len(tokens) - 1
            yield CompletionDelta(
                request.request_id, 0, (token,), (-0.5,), FinishReason.LENGTH if last else None, None, 0
            )

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        self.calls.append(("abort", None if request_ids is None else list(request_ids)))

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        self.calls.append(("pause", mode))

    @hookimpl
    async def rlinfer_resume(self) -> None:
        self.calls.append(("resume", None))

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        self.calls.append(("update_weights", update))
        if self.fail_update:
            raise RuntimeError("double: simulated load failure")

    @hookimpl
    async def rlinfer_stage_weights(self, staging_id: str, update: WeightUpdate) -> None:
        self.calls.append(("stage_weights", (staging_id, update)))
        if self.fail_stage:
            raise RuntimeError("double: simulated staging failure")
        self.staged.setdefault(staging_id, []).append(update)

    @hookimpl
    async def rlinfer_commit_staged_weights(self, staging_id: str, version: int) -> None:
        self.calls.append(("commit_staged_weights", (staging_id, version)))
        if self.fail_update:
            raise RuntimeError("double: simulated load failure")
        self.staged.pop(staging_id)

    @hookimpl
    async def rlinfer_cancel_staged_weights(self, staging_id: str) -> None:
        self.calls.append(("cancel_staged_weights", staging_id))
        self.staged.pop(staging_id, None)

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        self.calls.append(("init_weight_broadcast", group))

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        self.calls.append(("release_memory", (tags, discard_weights) if discard_weights else tags))

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        self.calls.append(("resume_memory", tags))

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        self.calls.append(("check_health", None))

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
        self.calls.append(("shutdown", None))

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        self.calls.append(("bench_raw_generate", [r.request_id for r in requests]))
        return sum(r.sampling.max_tokens * r.sampling.n for r in requests)

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        self.calls.append(("bench_raw_weight_update", path))

    @hookimpl
    def rlinfer_parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """A pure-Python hermes parser standing in for an engine's (whatever ``parser`` says)."""
        self.calls.append(("parse_tool_calls", parser))
        calls = []
        for raw in re.findall(r"<tool_call>.*?(?:</tool_call>|$)", text, flags=re.S):
            body = raw.removeprefix("<tool_call>").removesuffix("</tool_call>")
            try:
                data = json.loads(body)
                calls.append(ToolCall(data["name"], data["arguments"], json.dumps(data["arguments"]), raw))
            except (ValueError, KeyError) as exc:
                calls.append(ToolCall(None, raw=raw, error=f"not a call: {exc}"))
        return ToolCalls(parser, tuple(calls), text.split("<tool_call>")[0] or None)

    @hookimpl
    async def rlinfer_load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        self.calls.append(("load_lora", adapter.name))
        assert (adapter.name in self.adapters) == replace, "the facade knows which adapters are loaded"
        self.adapters[adapter.name] = adapter

    @hookimpl
    async def rlinfer_unload_lora(self, name: str) -> None:
        self.calls.append(("unload_lora", name))
        del self.adapters[name]

    @hookimpl
    async def rlinfer_list_loras(self) -> list[str]:
        return list(self.adapters)


def make_double(config: EngineConfig) -> RecordingDoubleBackend:
    """Factory named by :data:`DOUBLE_INFO`; ``without`` hooks are None (not implemented)."""
    without = config.engine_kwargs.get("without", ())
    if without:
        return type("PartialDouble", (RecordingDoubleBackend,), dict.fromkeys(without))(config)  # type: ignore[no-any-return]
    return RecordingDoubleBackend(config)


def describe() -> Capabilities:
    """Capabilities without building the double."""
    return Capabilities("double", "0.0", "cpu", DEFAULT_SUPPORTED)


#: registered under ``rlinfer.backends`` by a throwaway dist-info in the tests; the "engine"
#: requirement is pluggy, which is always installed next to rlinfer_core
DOUBLE_INFO = BackendInfo("double", ("pluggy>=1",), "recording_double:make_double", describe, summary="test double")


class RecordingObserver:
    """Observer plugin that records every event it receives."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def of(self, name: str) -> list[dict[str, Any]]:
        """Keyword arguments of every ``name`` event."""
        return [kw for n, kw in self.events if n == name]

    @hookimpl
    def rlinfer_on_engine_started(self, backend: str, capabilities: Capabilities, seconds: float) -> None:
        self.events.append(("started", {"backend": backend, "capabilities": capabilities, "seconds": seconds}))

    @hookimpl
    def rlinfer_on_generate_done(
        self, backend: str, requests: Sequence[GenerateRequest], completions: Sequence[Completion], seconds: float
    ) -> None:
        self.events.append(("generate_done", {"requests": list(requests), "completions": list(completions)}))

    @hookimpl
    def rlinfer_on_weights_updated(self, backend: str, version: int, transport: str, nbytes: int) -> None:
        self.events.append(("weights_updated", {"version": version, "transport": transport, "nbytes": nbytes}))

    @hookimpl
    def rlinfer_on_weight_update_failed(self, transport: str, error: Exception) -> None:
        self.events.append(("weight_update_failed", {"transport": transport, "error": error}))

    @hookimpl
    def rlinfer_on_engine_shutdown(self, backend: str) -> None:
        self.events.append(("shutdown", {"backend": backend}))
