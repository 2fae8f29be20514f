"""The typed backend boundary: what the facade calls on a backend object, with real types.

:mod:`rlinfer_core.hookspecs` stays the published contract (pluggy validates every hookimpl's
argument names against it when the facade registers a backend, and observers use its event
hooks). These protocols say the same for the type checker, so the facade calls typed methods and
a backend can let mypy check it::

    class MyBackend:  # structural: no base class needed
        ...

    if TYPE_CHECKING:  # mypy checks every hook's presence and signature
        _checked: type[rlinfer_core.backend.FullBackend] = MyBackend

(a backend that implements only some optional protocols checks against a protocol combining
those, as ``rlinfer_sglang.backend`` does).

:class:`Backend` holds the hooks every backend implements. The others are optional, each behind
the capability that needs it: a backend that does not claim a capability need not implement its
hooks (the facade raises :class:`~rlinfer_core.errors.UnsupportedCapability` before reaching
them). Members return ``Awaitable`` so that ``async def`` methods and plain methods returning an
awaitable both fit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from rlinfer_core.errors import BackendLoadError, UnsupportedCapability
from rlinfer_core.types import Capability

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum
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

T = TypeVar("T")


@runtime_checkable
class Backend(Protocol):
    """The operation hooks every backend implements (see :mod:`rlinfer_core.hookspecs`)."""

    def rlinfer_start(self, config: EngineConfig) -> Awaitable[None]:
        """Start the engine; return once it serves."""
        ...

    def rlinfer_capabilities(self) -> Capabilities:
        """What the backend truly supports here."""
        ...

    def rlinfer_model_info(self) -> ModelInfo:
        """Vocabulary size, context length, EOS ids of the served model."""
        ...

    def rlinfer_check_health(self) -> Awaitable[None]:
        """Raise EngineDead when the engine can no longer serve."""
        ...

    def rlinfer_shutdown(self) -> Awaitable[None]:
        """Stop the engine and every process it started (idempotent)."""
        ...

    def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> Awaitable[list[Completion]]:
        """Run a batch to completion: ``n`` completions per request, in order."""
        ...

    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """HF parameter names the engine accepts, with dtype and shape."""
        ...

    def rlinfer_update_weights(self, update: WeightUpdate) -> Awaitable[None]:
        """Load a validated weight update, all or nothing."""
        ...


@runtime_checkable
class StreamingBackend(Protocol):
    """:attr:`Capability.STREAM`."""

    def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Deltas of one request that concatenate to what ``rlinfer_generate`` returns."""
        ...


@runtime_checkable
class AbortingBackend(Protocol):
    """:attr:`Capability.ABORT` (and ``pause(mode="abort")``)."""

    def rlinfer_abort(self, request_ids: Sequence[str] | None) -> Awaitable[None]:
        """Abort the given requests (None: all)."""
        ...


@runtime_checkable
class PausingBackend(Protocol):
    """:attr:`Capability.PAUSE_ABORT`, ``PAUSE_WAIT``, ``PAUSE_KEEP``."""

    def rlinfer_pause(self, mode: PauseMode) -> Awaitable[None]:
        """Pause generation."""
        ...

    def rlinfer_resume(self) -> Awaitable[None]:
        """Resume generation."""
        ...


@runtime_checkable
class BroadcastBackend(Protocol):
    """:attr:`Capability.WEIGHTS_BROADCAST`."""

    def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> Awaitable[None]:
        """Join the trainer's weight group."""
        ...


@runtime_checkable
class ChecksumBackend(Protocol):
    """:attr:`Capability.WEIGHTS_CHECKSUM`."""

    def rlinfer_weights_checksum(self) -> Awaitable[Mapping[str, WeightChecksum]]:
        """Checksums of the served tensors, computed inside the engine (HF names)."""
        ...


@runtime_checkable
class MemoryBackend(Protocol):
    """:attr:`Capability.MEMORY_RELEASE`."""

    def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> Awaitable[None]:
        """Free accelerator memory for ``tags``; ``discard_weights``: without a host backup of the
        weights (:attr:`Capability.MEMORY_DISCARD_WEIGHTS`)."""
        ...

    def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> Awaitable[None]:
        """Re-allocate what release freed."""
        ...


@runtime_checkable
class PrefixCacheBackend(Protocol):
    """:attr:`Capability.PREFIX_CACHE_RESET`."""

    def rlinfer_reset_prefix_cache(self) -> Awaitable[None]:
        """Drop every cached prefix."""
        ...


@runtime_checkable
class ProcessesBackend(Protocol):
    """Reports the engine's child processes (the kit's fault matrix needs it)."""

    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's child processes now running."""
        ...


@runtime_checkable
class BenchBackend(Protocol):
    """:attr:`Capability.BENCH`: the raw-engine baselines of ``rlinfer bench``. Optional: a backend
    passes the conformance kit without it."""

    def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> Awaitable[int]:
        """Run ``requests`` through the engine's native API; return the generated token count."""
        ...

    def rlinfer_bench_raw_weight_update(self, path: str) -> Awaitable[None]:
        """Reload weights from a safetensors directory with the engine's own call, unvalidated."""
        ...


@runtime_checkable
class ToolsBackend(Protocol):
    """:attr:`Capability.TOOLS`: tool calls parsed by the engine's own parser."""

    def rlinfer_parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Parse tool calls in ``text`` with the engine's own parser."""
        ...


@runtime_checkable
class LoraBackend(Protocol):
    """:attr:`Capability.LORA`: adapters loaded, updated in place, unloaded, listed."""

    def rlinfer_load_lora(self, adapter: LoraAdapter, replace: bool) -> Awaitable[None]:
        """Load (or, with ``replace``, update in place) an adapter."""
        ...

    def rlinfer_unload_lora(self, name: str) -> Awaitable[None]:
        """Unload an adapter."""
        ...

    def rlinfer_list_loras(self) -> Awaitable[Sequence[str]]:
        """Names of the adapters the engine holds."""
        ...


class FullBackend(
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
    """Every operation hook: for backends that implement them all and want mypy to check it."""


#: optional protocol -> the capability whose claim it backs (ProcessesBackend has none)
OPTIONAL: Mapping[type, Capability | None] = {
    StreamingBackend: Capability.STREAM,
    AbortingBackend: Capability.ABORT,
    PausingBackend: None,  # three capabilities (pause.abort / wait / keep)
    BroadcastBackend: Capability.WEIGHTS_BROADCAST,
    ChecksumBackend: Capability.WEIGHTS_CHECKSUM,
    MemoryBackend: Capability.MEMORY_RELEASE,
    PrefixCacheBackend: Capability.PREFIX_CACHE_RESET,
    ProcessesBackend: None,
    BenchBackend: Capability.BENCH,
    ToolsBackend: Capability.TOOLS,
    LoraBackend: Capability.LORA,
}


def _members(protocol: type) -> list[str]:
    return sorted(n for n in vars(protocol) if n.startswith("rlinfer_"))


def check_backend(name: str, obj: Any) -> Backend:
    """Return ``obj`` typed as a :class:`Backend`; raise BackendLoadError naming the missing
    required hooks otherwise."""
    if isinstance(obj, Backend):
        return obj
    missing = [m for m in _members(Backend) if not callable(getattr(obj, m, None))]
    raise BackendLoadError(
        f"backend {name!r}: its factory returned {type(obj).__name__}, which lacks the required "
        f"operation hooks {missing} (see rlinfer_core.backend.Backend)"
    )


def claimed_but_missing(obj: Any, supported: frozenset[Capability]) -> list[str]:
    """Hooks a backend lacks although it claims the capability they back (a dishonest claim)."""
    problems = []
    for protocol, capability in OPTIONAL.items():
        if capability is not None and capability in supported and not isinstance(obj, protocol):
            missing = [m for m in _members(protocol) if not callable(getattr(obj, m, None))]
            problems.append(f"{capability.value} needs {', '.join(missing)}")
    return problems


def present(impl: T | None, hook: str, backend: str) -> T:
    """``impl`` when the backend implements ``hook``; UnsupportedCapability otherwise."""
    if impl is None:
        raise UnsupportedCapability(hook, backend, "the backend does not implement this hook")
    return impl


__all__ = [
    "AbortingBackend",
    "Backend",
    "BenchBackend",
    "BroadcastBackend",
    "ChecksumBackend",
    "FullBackend",
    "LoraBackend",
    "MemoryBackend",
    "PausingBackend",
    "PrefixCacheBackend",
    "ProcessesBackend",
    "StreamingBackend",
    "ToolsBackend",
    "check_backend",
    "claimed_but_missing",
    "present",
]
