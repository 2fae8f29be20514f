# ruff: noqa: D102  (each member takes its hookspec's docstring: _view_of_hookspecs)
"""The typed view of the operation hooks: what the facade calls on a backend object, with types.

:mod:`rlinfer_core.hookspecs` is the contract, stated once: names, parameters, return types,
docstrings, and which hooks are optional behind which capabilities (its ``optional`` marker).
pluggy validates every hookimpl's argument names against it when the facade registers a backend.
These protocols are its view for the type checker: each member has its hookspec's name,
parameters and return type and takes its hookspec's docstring (:func:`_view_of_hookspecs`), and
``tests/core/test_contract_stated_once.py`` checks the view against the specs mechanically. A
backend can let mypy check it::

    class MyBackend:  # structural: no base class needed
        ...

    if TYPE_CHECKING:  # mypy checks every hook's presence and signature
        _checked: type[rlinfer_core.backend.FullBackend] = MyBackend

(a backend that implements only some optional protocols checks against a protocol combining
those, as ``rlinfer_sglang.backend`` does).

:class:`Backend` holds the required hooks; every other protocol groups optional hooks that back
the same capabilities. The facade reaches an optional hook only through :func:`optional_hook`
(:meth:`rlinfer_core.engine_calls.BackendCalls.optional`), which raises
:class:`~rlinfer_core.errors.UnsupportedCapability` with the backend's note before reaching a
hook whose capability is not claimed. Members return ``Awaitable`` so that ``async def`` methods
and plain methods returning an awaitable both fit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, runtime_checkable

from rlinfer_core import hookspecs
from rlinfer_core.errors import BackendLoadError, UnsupportedCapability
from rlinfer_core.types import Capabilities, Capability

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum
    from rlinfer_core.lora import LoraAdapter
    from rlinfer_core.model_info import ModelInfo
    from rlinfer_core.tools import ToolCalls, ToolSpec
    from rlinfer_core.types import (
        Completion,
        CompletionDelta,
        EngineConfig,
        GenerateRequest,
        MemoryTag,
        PauseMode,
    )
    from rlinfer_core.weights import BroadcastGroup, TensorSpec, WeightUpdate

ProtocolT = TypeVar("ProtocolT", bound=type)
Impl = TypeVar("Impl")
Result = TypeVar("Result")
Params = ParamSpec("Params")


def _members(protocol: type) -> list[str]:
    return sorted(n for n in vars(protocol) if n.startswith("rlinfer_"))


def hook_capabilities(hook: str) -> frozenset[Capability] | None:
    """The capabilities the optional operation hook ``hook`` backs (its ``hookspecs.optional``
    marker; empty: optional outright), or None for a required hook."""
    marked: frozenset[Capability] | None = getattr(getattr(hookspecs, hook), hookspecs.OPTIONAL_MARK, None)
    return marked


def _view_of_hookspecs(protocol: ProtocolT) -> ProtocolT:
    """Give each member of ``protocol`` the docstring of its hookspec (written once, there), and
    say in the protocol's docstring which capabilities its hooks back (from their markers)."""
    backs: set[Capability] = set()
    for name in _members(protocol):
        member = vars(protocol)[name]
        if member.__doc__ is not None:
            raise TypeError(f"{protocol.__name__}.{name} restates the docstring of rlinfer_core.hookspecs.{name}")
        member.__doc__ = getattr(hookspecs, name).__doc__
        backs |= hook_capabilities(name) or set()
    if backs:
        protocol.__doc__ = f"{protocol.__doc__}\n\nOptional: behind {', '.join(sorted(backs))}."
    return protocol


@runtime_checkable
@_view_of_hookspecs
class Backend(Protocol):
    """The operation hooks every backend implements."""

    def rlinfer_start(self, config: EngineConfig) -> Awaitable[None]: ...
    def rlinfer_capabilities(self) -> Capabilities: ...
    def rlinfer_model_info(self) -> ModelInfo: ...
    def rlinfer_check_health(self) -> Awaitable[None]: ...
    def rlinfer_shutdown(self) -> Awaitable[None]: ...
    def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> Awaitable[list[Completion]]: ...
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]: ...
    def rlinfer_update_weights(self, update: WeightUpdate) -> Awaitable[None]: ...


@runtime_checkable
@_view_of_hookspecs
class StreamingBackend(Protocol):
    """Streams one request."""

    def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]: ...


@runtime_checkable
@_view_of_hookspecs
class AbortingBackend(Protocol):
    """Aborts requests (``abort()``, and ``pause(mode="abort")`` for what is in flight)."""

    def rlinfer_abort(self, request_ids: Sequence[str] | None) -> Awaitable[None]: ...


@runtime_checkable
@_view_of_hookspecs
class PausingBackend(Protocol):
    """Pauses and resumes generation."""

    def rlinfer_pause(self, mode: PauseMode) -> Awaitable[None]: ...
    def rlinfer_resume(self) -> Awaitable[None]: ...


@runtime_checkable
@_view_of_hookspecs
class BroadcastBackend(Protocol):
    """Joins the trainer's weight broadcast group."""

    def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> Awaitable[None]: ...


@runtime_checkable
@_view_of_hookspecs
class ChecksumBackend(Protocol):
    """Checksums the served weights inside the engine."""

    def rlinfer_weights_checksum(self) -> Awaitable[Mapping[str, WeightChecksum]]: ...


@runtime_checkable
@_view_of_hookspecs
class StagingBackend(Protocol):
    """Stages weights in the engine while it generates."""

    def rlinfer_stage_weights(self, staging_id: str, update: WeightUpdate) -> Awaitable[None]: ...
    def rlinfer_commit_staged_weights(self, staging_id: str, version: int) -> Awaitable[None]: ...
    def rlinfer_cancel_staged_weights(self, staging_id: str) -> Awaitable[None]: ...


@runtime_checkable
@_view_of_hookspecs
class MemoryBackend(Protocol):
    """Releases and resumes accelerator memory."""

    def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> Awaitable[None]: ...
    def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> Awaitable[None]: ...


@runtime_checkable
@_view_of_hookspecs
class PrefixCacheBackend(Protocol):
    """Resets the prefix cache."""

    def rlinfer_reset_prefix_cache(self) -> Awaitable[None]: ...


@runtime_checkable
@_view_of_hookspecs
class ProcessesBackend(Protocol):
    """Reports the engine's child processes (the kit's fault matrix needs it)."""

    def rlinfer_engine_processes(self) -> Mapping[str, int]: ...


@runtime_checkable
@_view_of_hookspecs
class BenchBackend(Protocol):
    """The raw-engine baselines of ``rlinfer bench`` (a backend passes the kit without them)."""

    def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> Awaitable[int]: ...
    def rlinfer_bench_raw_weight_update(self, path: str) -> Awaitable[None]: ...


@runtime_checkable
@_view_of_hookspecs
class ToolsBackend(Protocol):
    """Parses tool calls with the engine's own parser."""

    def rlinfer_parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls: ...


@runtime_checkable
@_view_of_hookspecs
class LoraBackend(Protocol):
    """LoRA adapters: loaded, updated in place, unloaded, listed."""

    def rlinfer_load_lora(self, adapter: LoraAdapter, replace: bool) -> Awaitable[None]: ...
    def rlinfer_unload_lora(self, name: str) -> Awaitable[None]: ...
    def rlinfer_list_loras(self) -> Awaitable[Sequence[str]]: ...


class FullBackend(
    Backend,
    StreamingBackend,
    AbortingBackend,
    PausingBackend,
    BroadcastBackend,
    ChecksumBackend,
    StagingBackend,
    MemoryBackend,
    PrefixCacheBackend,
    ProcessesBackend,
    BenchBackend,
    ToolsBackend,
    LoraBackend,
    Protocol,
):
    """Every operation hook: for backends that implement them all and want mypy to check it."""


#: the protocols of optional hooks (what each backs: :func:`hook_capabilities` of its members)
OPTIONAL: tuple[type, ...] = tuple(p for p in FullBackend.__bases__ if p not in (Backend, Protocol))


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


def _optional_hooks() -> dict[str, frozenset[Capability]]:
    return {
        name: marked
        for name in vars(hookspecs)
        if name.startswith("rlinfer_") and (marked := hook_capabilities(name)) is not None
    }


def claimed_but_missing(obj: Any, supported: frozenset[Capability]) -> list[str]:
    """Hooks a backend lacks although it claims a capability they back (a dishonest claim)."""
    missing: dict[Capability, list[str]] = {}
    for hook, backs in _optional_hooks().items():
        if not callable(getattr(obj, hook, None)):
            for capability in backs & supported:
                missing.setdefault(capability, []).append(hook)
    return [f"{c.value} needs {', '.join(sorted(hooks))}" for c, hooks in sorted(missing.items())]


def optional_hook(
    obj: Any,
    hook: Callable[Concatenate[Impl, Params], Result],
    capabilities: Capabilities,
    needs: Capability | None,
    backend: str,
) -> Callable[Params, Result]:
    """The implementation of the optional hook ``hook`` (a member of one of these protocols, e.g.
    ``LoraBackend.rlinfer_load_lora``) by ``obj``, the backend named ``backend``, typed as the
    protocol states it.

    First the capability: ``needs`` (one of those the hook backs, for a hook that backs several),
    else the hook's one capability, else any of its several; UnsupportedCapability with the
    backend's note when it is not claimed. Then the hook: UnsupportedCapability naming it when the
    backend does not implement it (a hook with no capability, or a backend refused at open)."""
    name = hook.__name__
    backs = hook_capabilities(name)
    if backs is None:
        raise TypeError(f"{name} is a required hook; call it on the backend directly")
    if needs is not None:
        if needs not in backs:
            raise TypeError(f"{name} does not back {needs.value} (it backs {sorted(backs)})")
        capabilities.require(needs)
    elif backs and not backs & capabilities.supported:
        capabilities.require(min(backs))
    impl = implemented(obj, hook)
    if impl is None:
        raise UnsupportedCapability(name, backend, "the backend does not implement this hook")
    return impl


def implemented(obj: Any, hook: Callable[Concatenate[Impl, Params], Result]) -> Callable[Params, Result] | None:
    """The backend ``obj``'s implementation of the optional hook ``hook``, or None; for calls that
    are skipped where the hook is missing (``resume``, a quiet abort after a timeout)."""
    impl = getattr(obj, hook.__name__, None)
    return impl if callable(impl) else None


__all__ = [
    "OPTIONAL",
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
    "StagingBackend",
    "StreamingBackend",
    "ToolsBackend",
    "check_backend",
    "claimed_but_missing",
    "hook_capabilities",
    "implemented",
    "optional_hook",
]
