"""The blocking twin of :class:`~rlinfer_ray.pool.EnginePool`: :class:`rlinfer_core.engine.Engine`
(``async_engine`` is the pool) with the members where the pool differs derived from the pool
(see :mod:`rlinfer_core.sync_twin`)."""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar, cast

from rlinfer_core.errors import EngineDead
from rlinfer_core.session import Session
from rlinfer_core.sync_engine import Engine
from rlinfer_core.sync_twin import Delegated, blocking, converted, delegated, delegated_property, iterating
from rlinfer_core.types import EngineConfig
from rlinfer_ray.config import PoolConfig
from rlinfer_ray.pool import EnginePool
from rlinfer_ray.router import Router

T = TypeVar("T")


class SyncEnginePool(Engine):
    """Synchronous pool: every member of :class:`EnginePool`, blocking until done."""

    @property
    def pool(self) -> EnginePool:
        """The async pool behind this twin."""
        return cast(EnginePool, self.async_engine)

    @classmethod
    def open(
        cls,
        backend: str,
        config: EngineConfig | None = None,
        *,
        pool: PoolConfig | None = None,
        plugins: Sequence[Any] = (),
        load_entry_point_plugins: bool = True,
        **config_fields: Any,
    ) -> SyncEnginePool:
        """Start a pool (see :meth:`EnginePool.open` for the arguments) on its own loop thread."""
        return cls._open_on_loop(
            lambda: EnginePool.open(
                backend,
                config,
                pool=pool,
                plugins=plugins,
                load_entry_point_plugins=load_entry_point_plugins,
                **config_fields,
            ),
            "rlinfer-pool-loop",
        )

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():  # shut down: the loop is gone, nothing would ever answer
            coro.close()
            raise EngineDead("the engine pool was shut down; open a new one")
        return super()._run(coro)

    # --- where the pool's surface differs from AsyncEngine's ---------------------------------------

    pool_config = Delegated[PoolConfig]()
    router = Delegated[Router]()
    last_update_fanout_s = Delegated[dict[int, float]]()
    replicas = delegated_property(EnginePool.replicas)
    replica_states = delegated(EnginePool.replica_states)
    wait_ready = blocking(EnginePool.wait_ready)
    generate = blocking(EnginePool.generate)
    generate_over_sampled = blocking(EnginePool.generate_over_sampled)
    stream = iterating(EnginePool.stream)
    session = converted(EnginePool.session, Session)
    bench_generate_on = blocking(EnginePool.bench_generate_on)


def open_pool(
    backend: str, config: EngineConfig | None = None, *, pool: PoolConfig | None = None, **kwargs: Any
) -> SyncEnginePool:
    """Start a synchronous pool; ``EnginePool.open`` is the async twin."""
    return SyncEnginePool.open(backend, config, pool=pool, **kwargs)
