"""The synchronous twin of :class:`~rlinfer_core.engine.AsyncEngine`, derived from it member by
member (see :mod:`rlinfer_core.sync_twin` for how, and why one line per member)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar, cast

from rlinfer_core.engine import AsyncEngine
from rlinfer_core.errors import EngineDead
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.oom_retry import OutOfMemoryRetry
from rlinfer_core.session import Session
from rlinfer_core.staging import WeightStaging
from rlinfer_core.sync_twin import (
    Delegated,
    SyncTwin,
    blocking,
    blocking_converted,
    converted,
    delegated,
    delegated_property,
    iterating,
)
from rlinfer_core.types import Capabilities, EngineConfig

T = TypeVar("T")
Y = TypeVar("Y")
EngineT = TypeVar("EngineT", bound="Engine")


class Engine(SyncTwin):
    """Synchronous twin of :class:`AsyncEngine` for scripts and notebooks.

    The async engine (``async_engine``) runs in its own event-loop thread; every method blocks
    until done. Each member below is the AsyncEngine member of the same name.
    """

    def __init__(self, async_engine: AsyncEngine, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self.async_engine = async_engine
        self._loop = loop
        self._thread = thread

    # --- what differs from the async engine: the loop thread's lifecycle --------------------------

    @classmethod
    def open(
        cls,
        backend: str,
        config: EngineConfig | None = None,
        *,
        plugins: Sequence[Any] = (),
        load_entry_point_plugins: bool = True,
        oom_retry: OutOfMemoryRetry | None = None,
        **config_fields: Any,
    ) -> Engine:
        """Start an engine on its own loop thread (see :meth:`AsyncEngine.open` for the arguments)."""
        return cls._open_on_loop(
            lambda: AsyncEngine.open(
                backend,
                config,
                plugins=plugins,
                load_entry_point_plugins=load_entry_point_plugins,
                oom_retry=oom_retry,
                **config_fields,
            ),
            "rlinfer-engine-loop",
        )

    @classmethod
    def _open_on_loop(cls: type[EngineT], opening: Callable[[], Coroutine[Any, Any, Any]], thread_name: str) -> EngineT:
        """Start a loop thread, run ``opening()`` (an async engine's ``open``) there and wrap its result."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=thread_name, daemon=True)
        thread.start()
        try:
            engine = asyncio.run_coroutine_threadsafe(opening(), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            raise
        return cls(engine, loop, thread)

    def shutdown(self) -> None:
        """Stop the engine and the loop thread. Safe to call twice."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self.async_engine.shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _target(self) -> AsyncEngine:
        return self.async_engine

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():  # after shutdown() the loop is gone: nothing would run it
            coro.close()
            raise EngineDead(f"engine {self.async_engine.backend_name!r} was shut down; open a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, iterator: AsyncIterator[Y]) -> Iterator[Y]:
        try:
            while True:
                try:
                    # an async generator's (or an async def __anext__'s) awaitable is a coroutine
                    yield self._run(cast(Coroutine[Any, Any, Y], anext(iterator)))
                except StopAsyncIteration:
                    return
        finally:
            close = getattr(iterator, "aclose", None)  # async generators have it, bare iterators not
            if close is not None and threading.current_thread() is self._thread:
                # an abandoned iterator finalized by the garbage collector on the loop's own
                # thread: waiting for the loop here would deadlock it, so close it as a task
                self._loop.create_task(close())
            elif close is not None:
                self._run(close())

    # --- state -----------------------------------------------------------------------------------

    backend_name = Delegated[str]()
    config = Delegated[EngineConfig]()
    capabilities = Delegated[Capabilities]()
    model_info = Delegated[ModelInfo | None]()
    weight_version = delegated_property(AsyncEngine.weight_version)
    weight_specs = delegated_property(AsyncEngine.weight_specs)
    released = delegated_property(AsyncEngine.released)
    in_flight = delegated_property(AsyncEngine.in_flight)
    weights_discarded = delegated_property(AsyncEngine.weights_discarded)
    verifies_updates = delegated_property(AsyncEngine.verifies_updates)
    broadcast_ranks = delegated_property(AsyncEngine.broadcast_ranks)

    # --- generation and control ------------------------------------------------------------------

    generate = blocking(AsyncEngine.generate)
    generate_over_sampled = blocking(AsyncEngine.generate_over_sampled)
    stream = iterating(AsyncEngine.stream)
    abort = blocking(AsyncEngine.abort)
    pause = blocking(AsyncEngine.pause)
    resume = blocking(AsyncEngine.resume)
    check_health = blocking(AsyncEngine.check_health)
    engine_processes = delegated(AsyncEngine.engine_processes)

    # --- weights, memory and cache ---------------------------------------------------------------

    update_weights = blocking(AsyncEngine.update_weights)
    stage_weights = blocking_converted(AsyncEngine.stage_weights, WeightStaging)  # a blocking handle
    staged_weight_limit = delegated_property(AsyncEngine.staged_weight_limit)
    init_weight_broadcast = blocking(AsyncEngine.init_weight_broadcast)
    weights_checksum = blocking(AsyncEngine.weights_checksum)
    verify_weights = blocking(AsyncEngine.verify_weights)
    checkpoint_names = delegated(AsyncEngine.checkpoint_names)
    release_memory = blocking(AsyncEngine.release_memory)
    resume_memory = blocking(AsyncEngine.resume_memory)
    reset_prefix_cache = blocking(AsyncEngine.reset_prefix_cache)
    bench_raw_generate = blocking(AsyncEngine.bench_raw_generate)
    bench_raw_weight_update = blocking(AsyncEngine.bench_raw_weight_update)

    # --- agent rollouts ------------------------------------------------------------------------

    session = converted(AsyncEngine.session, Session)  # a sync Session: model turns block like generate
    score = blocking(AsyncEngine.score)
    parse_tool_calls = blocking(AsyncEngine.parse_tool_calls)
    run_tool_loop = blocking(AsyncEngine.run_tool_loop)
    load_lora = blocking(AsyncEngine.load_lora)
    update_lora = blocking(AsyncEngine.update_lora)
    unload_lora = blocking(AsyncEngine.unload_lora)
    list_loras = blocking(AsyncEngine.list_loras)


def open_engine(backend: str, config: EngineConfig | None = None, **kwargs: Any) -> Engine:
    """Start a synchronous :class:`Engine`; ``AsyncEngine.open`` is the async twin."""
    return Engine.open(backend, config, **kwargs)
