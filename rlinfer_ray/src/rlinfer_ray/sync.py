"""The blocking twin of :class:`~rlinfer_ray.pool.EnginePool`, with the surface of
:class:`rlinfer_core.engine.Engine` (``async_engine`` is the pool, ``_loop`` its event loop)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

from rlinfer_core.errors import EngineDead
from rlinfer_core.sync_engine import Engine
from rlinfer_core.types import Completion, EngineConfig, GenerateRequest
from rlinfer_ray.config import PoolConfig
from rlinfer_ray.dataplane import Session
from rlinfer_ray.pool import EnginePool

T = TypeVar("T")


class SyncEnginePool(Engine):
    """Synchronous pool: every method of :class:`rlinfer_core.engine.Engine` blocks until done."""

    @property
    def pool(self) -> EnginePool:
        """The async pool behind this wrapper."""
        return cast(EnginePool, self.async_engine)

    @classmethod
    def open(
        cls, backend: str, config: EngineConfig | None = None, *, pool: PoolConfig | None = None, **kwargs: Any
    ) -> SyncEnginePool:
        """Start a pool (see :meth:`EnginePool.open` for the arguments) on its own loop thread."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="rlinfer-pool-loop", daemon=True)
        thread.start()
        try:
            opened = asyncio.run_coroutine_threadsafe(EnginePool.open(backend, config, pool=pool, **kwargs), loop)
            engine = opened.result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            raise
        return cls(cast(Any, engine), loop, thread)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():  # shut down: the loop is gone, nothing would ever answer
            coro.close()
            raise EngineDead("the engine pool was shut down; open a new one")
        return super()._run(coro)

    def generate(
        self, requests: GenerateRequest | Sequence[GenerateRequest], *, session: Session = None
    ) -> list[Completion]:
        """See :meth:`EnginePool.generate`."""
        return self._run(self.pool.generate(requests, session=session))

    def engine_processes(self) -> Mapping[str, int]:
        """See :meth:`EnginePool.engine_processes`."""
        return self.pool.engine_processes()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """See :meth:`EnginePool.wait_ready`."""
        self._run(self.pool.wait_ready(timeout_s))

    def replica_states(self) -> list[str]:
        """See :meth:`EnginePool.replica_states`."""
        return self.pool.replica_states()


def open_pool(
    backend: str, config: EngineConfig | None = None, *, pool: PoolConfig | None = None, **kwargs: Any
) -> SyncEnginePool:
    """Start a synchronous pool; ``EnginePool.open`` is the async twin."""
    return SyncEnginePool.open(backend, config, pool=pool, **kwargs)
