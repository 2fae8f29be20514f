"""EnginePool: N engine replicas on Ray behind the API of :class:`rlinfer_core.engine.AsyncEngine`.

This module holds the lifecycle, pause/resume, memory and cache fan-out. The data plane
(routing, retries, streams, aborts) is :mod:`rlinfer_ray.dataplane`; weight updates, broadcast
groups and restarts (all-or-nothing from the trainer's view) are :mod:`rlinfer_ray.control`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.admission import Admission
from rlinfer_core.errors import EngineDead, EngineTimeout
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.observers import Observers
from rlinfer_core.preflight import as_memory_tags
from rlinfer_core.preflight import pause_mode as preflight_pause_mode
from rlinfer_core.types import (
    Capabilities,
    Capability,
    EngineConfig,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import TensorSpec, WeightDelta, WeightSource, WeightUpdate
from rlinfer_ray.agent import PoolAgent
from rlinfer_ray.config import PoolConfig
from rlinfer_ray.dataplane import DataPlane
from rlinfer_ray.replicas import ReplicaSet, State
from rlinfer_ray.router import Router
from rlinfer_ray.staging import PoolStaging

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


class EnginePool(PoolAgent, PoolStaging, DataPlane):
    """Replicas of one engine, each in a Ray actor; open it with :meth:`open`."""

    def __init__(self, backend: str, config: EngineConfig, pool: PoolConfig, observers: Observers) -> None:
        super().__init__()
        self.backend_name = backend
        self.config = config
        self.pool_config = pool
        self._observers = observers
        #: the data plane's policy; may be replaced (e.g. ``Router(RouterPolicy.SESSION)``)
        self.router = Router(pool.policy, pool.session_load_factor)
        self._admission = Admission()
        self._routes: dict[str, set[tuple[int, str]]] = {}
        self._closed = False
        self._set: ReplicaSet | None = None
        self.capabilities: Capabilities | None = None
        self.model_info: ModelInfo | None = None
        self._weight_specs: Mapping[str, TensorSpec] = {}

    # --- lifecycle -----------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        backend: str,
        config: EngineConfig | None = None,
        *,
        pool: PoolConfig | None = None,
        plugins: Sequence[Any] = (),
        load_entry_point_plugins: bool = True,
        **config_fields: Any,
    ) -> EnginePool:
        """Start ``pool.replicas`` engines of ``backend`` on Ray (joined or started locally).

        Observer ``plugins`` (and the ``rlinfer.plugins`` entry points) see the pool's events in
        this process; the replicas run without observers of their own.
        """
        from rlinfer_core.discovery import plugin_objects
        from rlinfer_ray import cluster

        if config is None:
            config = EngineConfig(**config_fields)
        elif config_fields:
            config = attrs.evolve(config, **config_fields)
        pool = pool or PoolConfig()
        extra = plugin_objects() if load_entry_point_plugins else []
        self = cls(backend, config, pool, Observers(plugins, extra))
        started = time.perf_counter()
        cluster.ensure_ray(pool, pool.replicas * pool.cpus_per_replica)
        shape = cluster.bundle(pool, config)
        group = await cluster.reserve(pool, shape, config.startup_timeout_s)
        self._set = ReplicaSet(backend, config, pool.replicas, group, shape)
        try:
            for r in self._set.replicas:
                self._set.spawn(r)
            infos = await asyncio.gather(*(self._set.start(r) for r in self._set.replicas))
        except BaseException:
            await self._stop_all()
            raise
        for r in self._set.replicas:
            r.state = State.SERVING
        self.capabilities = infos[0]["capabilities"].without(POOL_UNSUPPORTED)
        self.model_info = infos[0]["model_info"]
        self._weight_specs = infos[0]["weight_specs"]
        self._observers.emit(
            "rlinfer_on_engine_started",
            backend=backend,
            capabilities=self.capabilities,
            seconds=time.perf_counter() - started,
        )
        return self

    async def __aenter__(self) -> EnginePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop every replica and give the placement group back. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stop_all()
        finally:
            self._observers.emit("rlinfer_on_engine_shutdown", backend=self.backend_name)

    async def _stop_all(self) -> None:
        from rlinfer_ray import cluster

        for task in list(self._restarts.values()):
            task.cancel()
        if self._set is None:
            return
        await asyncio.gather(*(self._set.stop(r, State.STOPPED) for r in self._set.replicas))
        with contextlib.suppress(Exception):
            cluster.release(self._set.group)

    @property
    def replicas(self) -> ReplicaSet:
        """The replica set (states, loads, versions)."""
        if self._set is None:
            raise EngineDead("the pool has not started")
        return self._set

    @property
    def weight_specs(self) -> Mapping[str, TensorSpec]:
        """HF parameter names the engines accept, with dtype and shape."""
        return self._weight_specs

    @property
    def released(self) -> frozenset[MemoryTag]:
        """Memory tags now released on every replica."""
        return frozenset(self._released)

    @property
    def in_flight(self) -> frozenset[str]:
        """Request ids handed to generate/stream that have not returned yet."""
        return self._admission.in_flight

    @property
    def weights_discarded(self) -> bool:
        """Always False: the pool refuses ``release_memory(discard_weights=True)`` (see
        :data:`POOL_UNSUPPORTED`)."""
        return False

    @property
    def verifies_updates(self) -> bool:
        """Whether every replica reads each update back and compares it (``EngineConfig.verify_updates``
        on engines with ``weights.checksum``)."""
        return self.config.verify_updates and self._caps().supports(Capability.WEIGHTS_CHECKSUM)

    def _ensure_open(self) -> None:
        if self._closed:
            raise EngineDead(f"engine pool of {self.backend_name!r} was shut down; open a new one")

    def _caps(self) -> Capabilities:
        assert self.capabilities is not None
        return self.capabilities

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause every replica (see PauseMode); new requests wait at the pool until resume()."""
        self._ensure_open()
        pause_mode = preflight_pause_mode(mode, self._caps())
        self._admission.close_gate()
        try:
            if pause_mode is PauseMode.WAIT:
                await asyncio.wait_for(self._admission.drained(), timeout=self.config.request_timeout_s)
            await self._control("pause", self.replicas.serving(), pause_mode, timeout=self.config.request_timeout_s)
            self._paused = pause_mode
        except TimeoutError:
            self._admission.open_gate()
            raise EngineTimeout(
                f"pause({pause_mode.value}) did not finish in {self.config.request_timeout_s} s"
            ) from None
        except BaseException:
            self._admission.open_gate()
            raise

    async def resume(self) -> None:
        """Resume every replica after :meth:`pause`."""
        self._ensure_open()
        try:
            await self._control("resume", self.replicas.serving())
        finally:
            self._paused = None
            self._admission.open_gate()

    async def update_weights(
        self,
        update: WeightUpdate | WeightSource | WeightDelta | Mapping[str, Any],
        *,
        version: int | None = None,
    ) -> int:
        """See the data plane's update_weights; a WeightDelta is refused (:data:`POOL_UNSUPPORTED`)."""
        if isinstance(update, WeightDelta):
            self._ensure_open()
            self._caps().require(Capability.WEIGHTS_DELTA)
            raise AssertionError("the pool never claims weights.delta")
        return await super().update_weights(update, version=version)

    # --- memory and cache ----------------------------------------------------------------------

    async def release_memory(
        self,
        tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None,
        *,
        discard_weights: bool = False,
    ) -> None:
        """Release memory on every replica (see AsyncEngine.release_memory); ``discard_weights``
        is refused (see :data:`POOL_UNSUPPORTED`)."""
        self._ensure_open()
        wanted = as_memory_tags(tags, self._caps())
        if discard_weights:
            self._caps().require(Capability.MEMORY_DISCARD_WEIGHTS)
        self._caps().require(Capability.MEMORY_RELEASE)
        todo = frozenset(wanted - self._released)
        if todo:
            started = time.perf_counter()
            await self._control("release_memory", self.replicas.serving(), todo, timeout=300.0)
            self._released |= todo
            self._observers.emit(
                "rlinfer_on_memory_released",
                backend=self.backend_name,
                tags=todo,
                seconds=time.perf_counter() - started,
            )

    async def resume_memory(self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None) -> None:
        """Resume memory on every replica (see AsyncEngine.resume_memory)."""
        self._ensure_open()
        wanted = as_memory_tags(tags, self._caps())
        self._caps().require(Capability.MEMORY_RELEASE)
        todo = frozenset(wanted & self._released)
        if todo:
            started = time.perf_counter()
            await self._control("resume_memory", self.replicas.serving(), todo, timeout=300.0)
            self._released -= todo
            self._observers.emit(
                "rlinfer_on_memory_resumed", backend=self.backend_name, tags=todo, seconds=time.perf_counter() - started
            )

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefixes on every replica."""
        self._ensure_open()
        self._caps().require(Capability.PREFIX_CACHE_RESET)
        await self._control("reset_prefix_cache", self.replicas.serving())

    async def check_health(self) -> None:
        """Check every serving replica; dead ones are restarted. EngineDead when none can serve."""
        self._ensure_open()
        await self._control("check_health", self.replicas.serving())
        if not self.replicas.serving():
            raise EngineDead(f"no replica of the pool is serving: {self.replica_states()}")

    # --- benchmarking --------------------------------------------------------------------------

    async def bench_raw_weight_update(self, path: str) -> None:
        """Every replica's own reload from a safetensors directory (unversioned bench baseline)."""
        self._ensure_open()
        self._caps().require(Capability.BENCH)
        await self._control(
            "bench_raw_weight_update", self.replicas.serving(), path, timeout=self.config.request_timeout_s
        )
