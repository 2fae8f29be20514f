"""The pool as a backend: N engine replicas on Ray under the one :class:`rlinfer_core.engine.AsyncEngine`.

:func:`open_async_pool` returns an ``AsyncEngine`` (:func:`open_pool` its blocking twin, an
``Engine``) whose backend object is a :class:`PoolBackend`: the facade validates, admits,
checks capabilities, stamps versions, owns stagings and the pause gate once per request, as for
one engine; the backend routes each call to its replicas. The pool's own controls (router,
replica states, restarts) are on the backend: :func:`pool_backend`.

This module holds the lifecycle and the fan-out hooks (pause, memory, cache, LoRA, tool calls).
The data plane (routing, retries, streams, aborts) is :mod:`rlinfer_ray.dataplane`; weight
updates, broadcast groups and restarts (all-or-nothing from the trainer's view) are
:mod:`rlinfer_ray.control`; staged updates :mod:`rlinfer_ray.staging`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from rlinfer_core.errors import EngineDead, InvalidRequest
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import Capabilities, Capability, EngineConfig, MemoryTag, PauseMode
from rlinfer_ray.config import PoolConfig
from rlinfer_ray.dataplane import DataPlane
from rlinfer_ray.router import Router
from rlinfer_ray.staging import PoolStaging

if TYPE_CHECKING:
    from rlinfer_core.discovery import BackendInfo
    from rlinfer_core.engine import AsyncEngine, Engine
    from rlinfer_core.lora import LoraAdapter
    from rlinfer_core.model_info import ModelInfo
    from rlinfer_core.tools import ToolCalls, ToolSpec
    from rlinfer_core.weights import TensorSpec
    from rlinfer_ray.replicas import ReplicaSet

#: what the pool does not pass on to its replicas, with the reason
POOL_UNSUPPORTED: Mapping[Capability, str] = {
    Capability.MEMORY_DISCARD_WEIGHTS: (
        "not implemented by the pool: a replica restarted while the weights are discarded would "
        "serve its start weights; release with the host backup (discard_weights=False)"
    ),
    Capability.WEIGHTS_DELTA: (
        "not implemented by the pool: a restarted replica is re-synced by replaying the last update, "
        "which a delta cannot be; send full updates"
    ),
}


def pool_capabilities(replica: Capabilities) -> Capabilities:
    """A replica's capabilities without :data:`POOL_UNSUPPORTED`, each noted with the pool's reason
    where the replica claims it or gives no reason of its own (a noted capability is one the
    facade does not build on others either: weights.delta)."""
    noted = {c.value: r for c, r in POOL_UNSUPPORTED.items() if c in replica.supported or c.value not in replica.notes}
    return attrs.evolve(replica, supported=replica.supported - set(POOL_UNSUPPORTED), notes={**replica.notes, **noted})


class PoolBackend(PoolStaging, DataPlane):
    """Replicas of one engine, each in a Ray actor, as one backend (the operation hooks of
    :mod:`rlinfer_core.hookspecs`). Open it with :func:`open_async_pool`; reach it from the
    engine with :func:`pool_backend` for its router, replica states and restarts."""

    def __init__(self, info: BackendInfo, config: EngineConfig, pool: PoolConfig) -> None:
        super().__init__()
        self.backend_name = info.name
        self.config = config
        self.pool_config = pool
        #: the data plane's policy; may be replaced (e.g. ``Router(RouterPolicy.SESSION)``)
        self.router = Router(pool.policy, pool.session_load_factor)
        self._routes: dict[str, set[tuple[int, str]]] = {}
        self._closed = False
        self._set: ReplicaSet | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # before the replicas answer: what the backend claims on this machine (checked by open())
        self._capabilities = pool_capabilities(info.describe())
        self._model_info: ModelInfo | None = None
        self._weight_specs: Mapping[str, TensorSpec] = {}
        #: every replica's update leaves no older prefix reachable (per-version cache keys), so
        #: the facade does not reset the replicas' prefix caches after a pool update
        self.update_invalidates_prefixes = False

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Reserve a placement group (Ray joined or started locally) and start every replica."""
        from rlinfer_ray import cluster
        from rlinfer_ray.replicas import ReplicaSet, State

        self._loop = asyncio.get_running_loop()
        pool = self.pool_config
        cluster.ensure_ray(pool, pool.replicas * pool.cpus_per_replica)
        shape = cluster.bundle(pool, config)
        group = await cluster.reserve(pool, shape, config.startup_timeout_s)
        self._set = ReplicaSet(self.backend_name, config, pool.replicas, group, shape)
        try:
            for r in self._set.replicas:
                self._set.spawn(r)
            infos = await asyncio.gather(*(self._set.start(r) for r in self._set.replicas))
        except BaseException:
            await self._stop_all()
            raise
        for r in self._set.replicas:
            r.state = State.SERVING
        self._capabilities = pool_capabilities(infos[0]["capabilities"])
        self._model_info = infos[0]["model_info"]
        self._weight_specs = infos[0]["weight_specs"]
        self.update_invalidates_prefixes = all(info["invalidates_prefixes"] for info in infos)

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        """The replicas' capabilities without :data:`POOL_UNSUPPORTED` (:func:`pool_capabilities`)."""
        return self._capabilities

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        """The replicas' model."""
        if self._model_info is None:
            raise EngineDead("the pool has not started")
        return self._model_info

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The replicas' weight specs."""
        return self._weight_specs

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
        """Stop every replica and give the placement group back."""
        self._closed = True
        await self._stop_all()

    async def _stop_all(self) -> None:
        from rlinfer_ray import cluster
        from rlinfer_ray.replicas import State

        for task in list(self._restarts.values()):
            task.cancel()
        if self._set is None:
            return
        await asyncio.gather(*(self._set.stop(r, State.STOPPED) for r in self._set.replicas))
        with contextlib.suppress(Exception):
            cluster.release(self._set.group)

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        """Check every serving replica; dead ones are restarted. EngineDead when none can serve."""
        await self._control("rlinfer_check_health", self.replicas.serving())
        if not self.replicas.serving():
            raise EngineDead(f"no replica of the pool is serving: {self.replica_states()}")

    @property
    def replicas(self) -> ReplicaSet:
        """The replica set (states, loads, versions)."""
        if self._set is None:
            raise EngineDead("the pool has not started")
        return self._set

    def replica_states(self) -> list[str]:
        """State of each replica, by index."""
        return [r.state.value for r in self.replicas.replicas]

    def wait_ready_blocking(self, timeout_s: float = 600.0) -> None:
        """:meth:`wait_ready` from a thread other than the pool's loop (e.g. beside an ``Engine``)."""
        assert self._loop is not None, "the pool has not started"
        asyncio.run_coroutine_threadsafe(self.wait_ready(timeout_s), self._loop).result()

    # --- fan-out hooks -------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """Pause every serving replica (a replica restarted meanwhile is paused as it re-syncs)."""
        await self._control("rlinfer_pause", self.replicas.serving(), mode, timeout=self.config.request_timeout_s)
        self._paused = mode

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """Resume every serving replica."""
        try:
            await self._control("rlinfer_resume", self.replicas.serving())
        finally:
            self._paused = None

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """Release ``tags`` on every replica (``discard_weights`` never comes: :data:`POOL_UNSUPPORTED`)."""
        if discard_weights:
            raise InvalidRequest("discard_weights", POOL_UNSUPPORTED[Capability.MEMORY_DISCARD_WEIGHTS])
        await self._control("rlinfer_release_memory", self.replicas.serving(), tags, timeout=300.0)

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """Resume ``tags`` on every replica."""
        await self._control("rlinfer_resume_memory", self.replicas.serving(), tags, timeout=300.0)

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """Drop cached prefixes on every replica."""
        await self._control("rlinfer_reset_prefix_cache", self.replicas.serving())

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """Every replica's own reload from a safetensors directory (unversioned bench baseline)."""
        await self._control(
            "rlinfer_bench_raw_weight_update", self.replicas.serving(), path, timeout=self.config.request_timeout_s
        )

    @hookimpl
    def rlinfer_parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Answered by one serving replica (an awaitable: the facade awaits what it gets)."""
        replica = self.replicas.serving()[0] if self.replicas.serving() else self.replicas.replicas[0]
        reply = self.replicas.call(
            replica, "rlinfer_parse_tool_calls", text, parser, list(tools), timeout=self.pool_config.control_timeout_s
        )
        return cast("ToolCalls", reply)

    async def _fan_lora(self, method: str, *args: Any) -> Any:
        members = self.replicas.serving()
        results = await self.replicas.fan_out(
            members, lambda r: self.replicas.call(r, method, *args, timeout=self.config.request_timeout_s)
        )
        self._raise_first(results)
        return results[min(results)] if results else None

    @hookimpl
    async def rlinfer_load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        """Load (or replace) ``adapter`` on every serving replica. A replica restarted later does
        not get adapters back: load them again (docs/fleet.md)."""
        import ray

        await self._fan_lora("rlinfer_load_lora", ray.put(adapter), replace)

    @hookimpl
    async def rlinfer_unload_lora(self, name: str) -> None:
        """Unload ``name`` on every serving replica."""
        await self._fan_lora("rlinfer_unload_lora", name)

    @hookimpl
    async def rlinfer_list_loras(self) -> Sequence[str]:
        """The adapters of the first serving replica."""
        names: Sequence[str] = await self._fan_lora("rlinfer_list_loras")
        return list(names or ())


async def open_async_pool(
    backend: str,
    config: EngineConfig | None = None,
    *,
    pool: PoolConfig | None = None,
    plugins: Sequence[Any] = (),
    load_entry_point_plugins: bool = True,
    **config_fields: Any,
) -> AsyncEngine:
    """Start ``pool.replicas`` engines of ``backend`` on Ray; the :class:`AsyncEngine` over them.

    Arguments as :meth:`AsyncEngine.open`. Observer ``plugins`` (and the ``rlinfer.plugins``
    entry points) see the pool's events in this process; the replicas run without observers.
    """
    from rlinfer_core.discovery import get_backend, plugin_objects
    from rlinfer_core.engine import AsyncEngine

    if config is None:
        config = EngineConfig(**config_fields)
    elif config_fields:
        config = attrs.evolve(config, **config_fields)
    info = get_backend(backend)
    extra = plugin_objects() if load_entry_point_plugins else []
    return await AsyncEngine._open_backend(
        info, PoolBackend(info, config, pool or PoolConfig()), config, plugins, extra
    )


def open_pool(
    backend: str, config: EngineConfig | None = None, *, pool: PoolConfig | None = None, **kwargs: Any
) -> Engine:
    """Start a pool (see :func:`open_async_pool`) behind a blocking :class:`Engine` on its own loop thread."""
    from rlinfer_core.engine import Engine

    return Engine._open_on_loop(
        lambda: open_async_pool(backend, config, pool=pool, **kwargs),
        "rlinfer-pool-loop",
    )


def pool_backend(engine: AsyncEngine | Engine) -> PoolBackend:
    """The :class:`PoolBackend` under an engine opened by :func:`open_async_pool` / :func:`open_pool`:
    its ``router``, ``pool_config``, ``replicas``, ``replica_states()``, ``wait_ready()``,
    ``session(key)``, ``routed_to(indices)``, ``last_update_fanout_s``."""
    async_engine = cast("AsyncEngine", getattr(engine, "async_engine", engine))
    backend = async_engine._backend
    if not isinstance(backend, PoolBackend):
        raise TypeError(f"not a pool: the engine's backend is {type(backend).__name__}")
    return backend


if TYPE_CHECKING:  # the pool implements every operation hook (mypy checks it here)
    from rlinfer_core.backend import FullBackend

    _checked: type[FullBackend] = PoolBackend
