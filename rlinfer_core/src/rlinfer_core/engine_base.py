"""The facade's state and plumbing, shared by :class:`rlinfer_core.engine.AsyncEngine`'s parts:
the typed backend and its optional hooks, admission, the weight version, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from rlinfer_core import hookspecs
from rlinfer_core.admission import Admission
from rlinfer_core.agent import check_agent_request, derive_capabilities
from rlinfer_core.backend import AbortingBackend, Backend, check_backend, implemented, optional_hook
from rlinfer_core.discovery import BackendInfo
from rlinfer_core.errors import EngineDead, EngineTimeout, RLInferError
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.observers import Observers
from rlinfer_core.oom_retry import OutOfMemoryRetry
from rlinfer_core.preflight import check_config_limits, validate_request
from rlinfer_core.types import Capabilities, Capability, EngineConfig, GenerateRequest, MemoryTag
from rlinfer_core.weights import TensorSpec

T = TypeVar("T")
Impl = TypeVar("Impl")
Params = ParamSpec("Params")


class EngineBase:
    """State and plumbing of the facade; build an engine with ``AsyncEngine.open``."""

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
        self._info = info
        self._backend: Backend = check_backend(info.name, backend)
        # pluggy checks the backend's hookimpl signatures against the hookspecs at registration;
        # the facade then calls the typed methods. Observers live apart and cannot take them over.
        self._pm = hookspecs.PluginManager()
        self._pm.register(backend, name=f"backend:{info.name}")
        self._observers = Observers(plugins, entry_point_plugins)
        self._admission = Admission()
        #: retry generate after a transient EngineOutOfMemory (off unless ``open(oom_retry=...)``)
        self._oom_retry = OutOfMemoryRetry()
        self._version = 0
        self._released: set[MemoryTag] = set()
        self._weight_lock = asyncio.Lock()
        self._closed = False
        self.capabilities: Capabilities = derive_capabilities(self._backend.rlinfer_capabilities())
        self.model_info: ModelInfo | None = None
        self._weight_specs: Mapping[str, TensorSpec] | None = None

    @property
    def weight_version(self) -> int:
        """Version of the weights now served: 0 at start, +1 (or as requested) per update."""
        return self._version

    @property
    def weight_specs(self) -> Mapping[str, TensorSpec]:
        """HF parameter names the engine accepts, with dtype and shape."""
        if self._weight_specs is None:
            self._weight_specs = dict(self._backend.rlinfer_weight_specs())
        return self._weight_specs

    @property
    def released(self) -> frozenset[MemoryTag]:
        """Memory tags now released."""
        return frozenset(self._released)

    @property
    def in_flight(self) -> frozenset[str]:
        """Request ids handed to generate/stream that have not returned yet."""
        return self._admission.in_flight

    def _validate_request(self, request: GenerateRequest) -> None:
        self._ensure_open()
        validate_request(request, self.capabilities, self._released, self.model_info)
        check_config_limits(request, self.config)
        check_agent_request(self, request)  # tools, structured, lora (rlinfer_core.agent)

    # --- plumbing ------------------------------------------------------------------------------

    def _optional(
        self, hook: Callable[Concatenate[Impl, Params], T], needs: Capability | None = None
    ) -> Callable[Params, T]:
        """The backend's implementation of the optional ``hook`` (e.g. ``LoraBackend.rlinfer_load_lora``),
        the one way the facade reaches an optional hook: UnsupportedCapability with the backend's
        note unless it claims ``needs`` (default: what the hook backs), or naming the hook when
        the backend lacks it (:func:`rlinfer_core.backend.optional_hook`)."""
        return optional_hook(self._backend, hook, self.capabilities, needs, self.backend_name)

    def _implemented(self, hook: Callable[Concatenate[Impl, Params], T]) -> Callable[Params, T] | None:
        """The backend's implementation of the optional ``hook``, or None: for calls skipped where
        it is missing (``resume``, a quiet abort after a timeout)."""
        return implemented(self._backend, hook)

    def _ensure_open(self) -> None:
        if self._closed:
            raise EngineDead(f"engine {self.backend_name!r} was shut down; open a new one")

    async def _with_timeout(
        self,
        awaitable: Awaitable[T],
        timeout: float,
        what: str,
        on_timeout: Callable[[], Awaitable[None]] | None = None,
    ) -> T:
        try:
            return await asyncio.wait_for(awaitable, timeout=timeout)
        except TimeoutError:
            if on_timeout is not None:
                await on_timeout()
            raise EngineTimeout(
                f"{what} did not finish within {timeout:.0f} s on backend {self.backend_name!r}; "
                f"raise EngineConfig.request_timeout_s if the work is legitimately long"
            ) from None

    async def _engine_call(
        self,
        call: Callable[[], Awaitable[T]],
        timeout: float,
        what: str,
        on_timeout: Callable[[], Awaitable[None]] | None = None,
    ) -> T:
        """A request-path call (generate, each stream step): bounded by ``timeout``; an untyped
        error from a dead engine becomes EngineDead."""
        try:
            return await self._with_timeout(call(), timeout, what, on_timeout)
        except (RLInferError, StopAsyncIteration):
            raise
        except Exception as exc:
            await self._raise_if_dead(exc)
            raise

    async def _abort_quietly(self, request_ids: list[str]) -> None:
        abort = self._implemented(AbortingBackend.rlinfer_abort)
        if abort is None:
            return
        with contextlib.suppress(Exception):  # the timeout error is what the caller must see
            await asyncio.wait_for(abort(request_ids), timeout=10.0)

    async def _raise_if_dead(self, exc: BaseException) -> None:
        try:
            await asyncio.wait_for(self._backend.rlinfer_check_health(), timeout=10.0)
        except EngineDead:
            raise
        except TimeoutError:
            raise EngineDead(f"engine {self.backend_name!r} stopped answering after: {exc}") from exc
