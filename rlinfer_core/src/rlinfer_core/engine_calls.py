"""How the facade calls its backend: the typed backend, optional hooks reached by what the
engine claims, a deadline on every call, and a dead engine told apart from a failed call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Concatenate, ParamSpec, TypeVar

from rlinfer_core.backend import AbortingBackend, Backend, implemented, optional_hook
from rlinfer_core.errors import EngineDead, EngineTimeout, RLInferError
from rlinfer_core.types import Capabilities, Capability

T = TypeVar("T")
Impl = TypeVar("Impl")
Params = ParamSpec("Params")


class BackendCalls:
    """The facade's one way into ``backend``; ``capabilities`` returns what the engine claims now."""

    def __init__(self, name: str, backend: Backend, capabilities: Callable[[], Capabilities]) -> None:
        self.name = name
        self.backend = backend
        self._capabilities = capabilities
        #: set by the facade's shutdown: every later call raises EngineDead
        self.closed = False

    @property
    def capabilities(self) -> Capabilities:
        """What the engine claims now (refined once it started)."""
        return self._capabilities()

    def ensure_open(self) -> None:
        """EngineDead once the engine was shut down."""
        if self.closed:
            raise EngineDead(f"engine {self.name!r} was shut down; open a new one")

    def optional(
        self, hook: Callable[Concatenate[Impl, Params], T], needs: Capability | None = None
    ) -> Callable[Params, T]:
        """The backend's implementation of the optional ``hook`` (e.g. ``LoraBackend.rlinfer_load_lora``),
        the one way the facade reaches an optional hook: UnsupportedCapability with the backend's
        note unless it claims ``needs`` (default: what the hook backs), or naming the hook when
        the backend lacks it (:func:`rlinfer_core.backend.optional_hook`)."""
        return optional_hook(self.backend, hook, self.capabilities, needs, self.name)

    def implemented(self, hook: Callable[Concatenate[Impl, Params], T]) -> Callable[Params, T] | None:
        """The backend's implementation of the optional ``hook``, or None: for calls skipped where
        it is missing (``resume``, a quiet abort after a timeout)."""
        return implemented(self.backend, hook)

    async def with_timeout(
        self,
        awaitable: Awaitable[T],
        timeout: float,
        what: str,
        on_timeout: Callable[[], Awaitable[None]] | None = None,
    ) -> T:
        """``awaitable``'s result, or EngineTimeout naming ``what`` after ``timeout`` seconds
        (``on_timeout`` is awaited first)."""
        try:
            return await asyncio.wait_for(awaitable, timeout=timeout)
        except TimeoutError:
            if on_timeout is not None:
                await on_timeout()
            raise EngineTimeout(
                f"{what} did not finish within {timeout:.0f} s on backend {self.name!r}; "
                f"raise EngineConfig.request_timeout_s if the work is legitimately long"
            ) from None

    async def engine_call(
        self,
        call: Callable[[], Awaitable[T]],
        timeout: float,
        what: str,
        on_timeout: Callable[[], Awaitable[None]] | None = None,
    ) -> T:
        """A request-path call (generate, each stream step): bounded by ``timeout``; an untyped
        error from a dead engine becomes EngineDead."""
        try:
            return await self.with_timeout(call(), timeout, what, on_timeout)
        except (RLInferError, StopAsyncIteration):
            raise
        except Exception as exc:
            await self.raise_if_dead(exc)
            raise

    async def abort_quietly(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` where the backend can, ignoring its errors (after a timeout, the
        timeout is what the caller must see)."""
        abort = self.implemented(AbortingBackend.rlinfer_abort)
        if abort is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(abort(request_ids), timeout=10.0)

    async def raise_if_dead(self, exc: BaseException) -> None:
        """EngineDead when the engine behind ``exc`` died or stopped answering; else return."""
        try:
            await asyncio.wait_for(self.backend.rlinfer_check_health(), timeout=10.0)
        except EngineDead:
            raise
        except TimeoutError:
            raise EngineDead(f"engine {self.name!r} stopped answering after: {exc}") from exc
