"""The synchronous wrapper around :class:`~rlinfer_core.engine.AsyncEngine`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rlinfer_core.errors import EngineDead
from rlinfer_core.types import (
    Capabilities,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    MemoryTag,
    PauseMode,
)

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum, WeightVerification
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_core.lora import LoraAdapter, LoraInfo
    from rlinfer_core.model_info import ModelInfo
    from rlinfer_core.scoring import Score, ScoreRequest
    from rlinfer_core.session import Session
    from rlinfer_core.tools import ToolCalls
    from rlinfer_core.weights import BroadcastGroup, TensorSpec, WeightDelta, WeightSource, WeightUpdate

T = TypeVar("T")


class Engine:
    """Synchronous wrapper around :class:`AsyncEngine` for scripts and notebooks.

    The async engine runs in its own event-loop thread; every method blocks until done.
    """

    def __init__(self, async_engine: AsyncEngine, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self.async_engine = async_engine
        self._loop = loop
        self._thread = thread

    @classmethod
    def open(cls, backend: str, config: EngineConfig | None = None, **kwargs: Any) -> Engine:
        """Start an engine (see :meth:`AsyncEngine.open` for the arguments)."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="rlinfer-engine-loop", daemon=True)
        thread.start()
        try:
            from rlinfer_core.engine import AsyncEngine

            engine = asyncio.run_coroutine_threadsafe(AsyncEngine.open(backend, config, **kwargs), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            raise
        return cls(engine, loop, thread)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():  # after shutdown() the loop is gone: nothing would run it
            coro.close()
            raise EngineDead(f"engine {self.async_engine.backend_name!r} was shut down; open a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def capabilities(self) -> Capabilities:
        """See :attr:`AsyncEngine.capabilities`."""
        return self.async_engine.capabilities

    @property
    def weight_version(self) -> int:
        """See :attr:`AsyncEngine.weight_version`."""
        return self.async_engine.weight_version

    @property
    def weight_specs(self) -> Mapping[str, TensorSpec]:
        """See :attr:`AsyncEngine.weight_specs`."""
        return self.async_engine.weight_specs

    @property
    def model_info(self) -> ModelInfo | None:
        """See :attr:`AsyncEngine.model_info`."""
        return self.async_engine.model_info

    def generate(self, requests: GenerateRequest | Sequence[GenerateRequest]) -> list[Completion]:
        """See :meth:`AsyncEngine.generate`."""
        return self._run(self.async_engine.generate(requests))

    def stream(self, request: GenerateRequest) -> Iterator[CompletionDelta]:
        """See :meth:`AsyncEngine.stream` (checked when called, before any iteration)."""
        return self._iterate(self.async_engine.stream(request))

    def _iterate(self, iterator: AsyncGenerator[CompletionDelta, None]) -> Iterator[CompletionDelta]:
        try:
            while True:
                try:
                    yield self._run(anext(iterator))
                except StopAsyncIteration:
                    return
        finally:
            if threading.current_thread() is self._thread:
                # an abandoned iterator finalized by the garbage collector on the loop's own
                # thread: waiting for the loop here would deadlock it, so close it as a task
                self._loop.create_task(iterator.aclose())
            else:
                self._run(iterator.aclose())

    def abort(self, request_ids: Sequence[str] | str | None = None) -> None:
        """See :meth:`AsyncEngine.abort`."""
        self._run(self.async_engine.abort(request_ids))

    def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """See :meth:`AsyncEngine.pause`."""
        self._run(self.async_engine.pause(mode))

    def resume(self) -> None:
        """See :meth:`AsyncEngine.resume`."""
        self._run(self.async_engine.resume())

    def update_weights(
        self, update: WeightUpdate | WeightSource | WeightDelta | Mapping[str, Any], *, version: int | None = None
    ) -> int:
        """See :meth:`AsyncEngine.update_weights`."""
        return self._run(self.async_engine.update_weights(update, version=version))

    @property
    def broadcast_ranks(self) -> int:
        """See :attr:`AsyncEngine.broadcast_ranks`."""
        return self.async_engine.broadcast_ranks

    def init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """See :meth:`AsyncEngine.init_weight_broadcast`."""
        self._run(self.async_engine.init_weight_broadcast(group))

    def release_memory(
        self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None, *, discard_weights: bool = False
    ) -> None:
        """See :meth:`AsyncEngine.release_memory`."""
        self._run(self.async_engine.release_memory(tags, discard_weights=discard_weights))

    def resume_memory(self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None) -> None:
        """See :meth:`AsyncEngine.resume_memory`."""
        self._run(self.async_engine.resume_memory(tags))

    @property
    def in_flight(self) -> frozenset[str]:
        """See :attr:`AsyncEngine.in_flight`."""
        return self.async_engine.in_flight

    def weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """See :meth:`AsyncEngine.weights_checksum`."""
        return self._run(self.async_engine.weights_checksum())

    def verify_weights(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> WeightVerification:
        """See :meth:`AsyncEngine.verify_weights`."""
        return self._run(self.async_engine.verify_weights(tensors))

    @property
    def verifies_updates(self) -> bool:
        """See :attr:`AsyncEngine.verifies_updates`."""
        return self.async_engine.verifies_updates

    def checkpoint_names(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """See :meth:`AsyncEngine.checkpoint_names`."""
        return self.async_engine.checkpoint_names(tensors)

    def engine_processes(self) -> Mapping[str, int]:
        """See :meth:`AsyncEngine.engine_processes`."""
        return self.async_engine.engine_processes()

    def reset_prefix_cache(self) -> None:
        """See :meth:`AsyncEngine.reset_prefix_cache`."""
        self._run(self.async_engine.reset_prefix_cache())

    def check_health(self) -> None:
        """See :meth:`AsyncEngine.check_health`."""
        self._run(self.async_engine.check_health())

    # --- agent rollouts (rlinfer_core.engine_agent) ----------------------------------------------

    def session(self, messages: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> Session:
        """See :meth:`AsyncEngine.session`; model turns block like :meth:`generate`."""
        from rlinfer_core.session import Session

        return Session(self, self.async_engine.session(messages, **kwargs))

    def score(self, requests: ScoreRequest | Sequence[ScoreRequest]) -> list[Score]:
        """See :meth:`AsyncEngine.score`."""
        return self._run(self.async_engine.score(requests))

    def parse_tool_calls(self, text: str, parser: str, tools: Any = None) -> ToolCalls:
        """See :meth:`AsyncEngine.parse_tool_calls`."""
        return self._run(self.async_engine.parse_tool_calls(text, parser, tools))

    def load_lora(self, adapter: LoraAdapter) -> LoraInfo:
        """See :meth:`AsyncEngine.load_lora`."""
        return self._run(self.async_engine.load_lora(adapter))

    def update_lora(self, adapter: LoraAdapter) -> LoraInfo:
        """See :meth:`AsyncEngine.update_lora`."""
        return self._run(self.async_engine.update_lora(adapter))

    def unload_lora(self, name: str) -> None:
        """See :meth:`AsyncEngine.unload_lora`."""
        self._run(self.async_engine.unload_lora(name))

    def list_loras(self) -> list[LoraInfo]:
        """See :meth:`AsyncEngine.list_loras`."""
        return self._run(self.async_engine.list_loras())

    def shutdown(self) -> None:
        """Stop the engine and the loop thread. Safe to call twice."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self.async_engine.shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)


def open_engine(backend: str, config: EngineConfig | None = None, **kwargs: Any) -> Engine:
    """Start a synchronous :class:`Engine`; ``AsyncEngine.open`` is the async twin."""
    return Engine.open(backend, config, **kwargs)
