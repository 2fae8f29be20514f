"""The pool as a backend: N engine replicas on Ray under the one :class:`rlinfer_core.engine.AsyncEngine`.

:func:`open_async_pool` returns an ``AsyncEngine`` (:func:`open_pool` its blocking twin, an
``Engine``) whose backend object is a :class:`PoolBackend`: the facade validates, admits,
checks capabilities, stamps versions, owns stagings and the pause gate once per request, as for
one engine; the backend routes each call to its replicas. The pool's own controls (router,
replica states, restarts) are on the backend: :func:`pool_backend`.

:class:`PoolBackend` holds the lifecycle and the hooks that only fan out (memory, cache, LoRA,
checksums, tool calls); the others go to components over its replica set, each owning its state:
:class:`~rlinfer_ray.control.ControlPlane` (version, pause, weight updates, broadcasts, restarts),
:class:`~rlinfer_ray.dataplane.DataPlane` (routing, streams, aborts), :class:`~rlinfer_ray.staging.PoolStaging`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from rlinfer_core.errors import EngineDead, InvalidRequest, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import Capabilities, Capability, EngineConfig, MemoryTag, PauseMode
from rlinfer_ray.config import PoolConfig
from rlinfer_ray.control import ControlPlane
from rlinfer_ray.dataplane import DataPlane
from rlinfer_ray.replicas import ReplicaSet, State
from rlinfer_ray.router import Router
from rlinfer_ray.staging import PoolStaging

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum
    from rlinfer_core.discovery import BackendInfo
    from rlinfer_core.engine import AsyncEngine, Engine
    from rlinfer_core.lora import LoraAdapter
    from rlinfer_core.model_info import ModelInfo
    from rlinfer_core.tools import ToolCalls, ToolSpec
    from rlinfer_core.types import Completion, CompletionDelta, GenerateRequest
    from rlinfer_core.weights import BroadcastGroup, TensorSpec, WeightUpdate

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


class PoolBackend:
    """Replicas of one engine, each in a Ray actor, as one backend (the operation hooks of
    :mod:`rlinfer_core.hookspecs`). Open it with :func:`open_async_pool`; reach it from the
    engine with :func:`pool_backend` for its router, replica states and restarts."""

    def __init__(self, info: BackendInfo, config: EngineConfig, pool: PoolConfig) -> None:
        self.backend_name = info.name
        self.config = config
        #: the replica set (states, loads, versions)
        self.replicas = ReplicaSet(info.name, config, pool.replicas)
        self._control = ControlPlane(self.replicas, config, pool)
        router = Router(pool.policy, pool.session_load_factor)
        self._data = DataPlane(self.replicas, self._control, router, config, pool)
        self._staging = PoolStaging(self.replicas, self._control, config)
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

        self._loop = asyncio.get_running_loop()
        pool = self.pool_config
        cluster.ensure_ray(pool, pool.replicas * pool.cpus_per_replica)
        shape = cluster.bundle(pool, config)
        self.replicas.place(await cluster.reserve(pool, shape, config.startup_timeout_s), shape)
        try:
            for r in self.replicas.replicas:
                self.replicas.spawn(r)
            infos = await asyncio.gather(*(self.replicas.start(r) for r in self.replicas.replicas))
        except BaseException:
            await self.rlinfer_shutdown()
            raise
        for r in self.replicas.replicas:
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
        from rlinfer_ray import cluster

        self._control.close()
        if self.replicas.group is None:
            return
        await asyncio.gather(*(self.replicas.stop(r, State.STOPPED) for r in self.replicas.replicas))
        with contextlib.suppress(Exception):
            cluster.release(self.replicas.group)

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        """Check every serving replica; dead ones are restarted. EngineDead when none can serve."""
        await self._control.call_all("rlinfer_check_health", self.replicas.serving())
        if not self.replicas.serving():
            raise EngineDead(f"no replica of the pool is serving: {self.replica_states()}")

    @hookimpl
    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{"replica<i>.<role>": pid}`` over every live replica, with each actor as ``.actor``.
        Blocking (as AsyncEngine's): call it outside the pool's event loop."""
        import ray

        out: dict[str, int] = {}
        for r in self.replicas.alive():
            status, value = ray.get(
                r.actor.call.remote("rlinfer_engine_processes"), timeout=self.pool_config.control_timeout_s
            )
            if status == "ok":
                out.update({f"replica{r.index}.{role}": pid for role, pid in value.items()})
            if r.pid is not None:
                out[f"replica{r.index}.actor"] = r.pid
        return out

    # --- the pool's own controls ---------------------------------------------------------------

    @property
    def pool_config(self) -> PoolConfig:
        """The pool's settings; one set here governs the running pool (e.g. ``retry`` off)."""
        return self._control.pool_config

    @pool_config.setter
    def pool_config(self, pool: PoolConfig) -> None:
        self._control.pool_config = self._data.pool_config = pool

    @property
    def router(self) -> Router:
        """The data plane's policy; may be replaced (e.g. ``Router(RouterPolicy.SESSION)``)."""
        return self._data.router

    @router.setter
    def router(self, router: Router) -> None:
        self._data.router = router

    @property
    def last_update_fanout_s(self) -> dict[int, float]:
        """The last weight update's fan-out: replica index -> seconds until it answered."""
        return self._control.last_update_fanout_s

    @property
    def broadcast_ranks(self) -> int:
        """Ranks the pool takes in a broadcast group: one per engine rank of each live replica."""
        return self.config.world_size * len(self.replicas.alive())

    def replica_states(self) -> list[str]:
        """State of each replica, by index."""
        return [r.state.value for r in self.replicas.replicas]

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Return once no restart is running and every replica serves (EngineDead otherwise)."""
        await self._control.wait_ready(timeout_s)

    def wait_ready_blocking(self, timeout_s: float = 600.0) -> None:
        """:meth:`wait_ready` from a thread other than the pool's loop (e.g. beside an ``Engine``)."""
        assert self._loop is not None, "the pool has not started"
        asyncio.run_coroutine_threadsafe(self.wait_ready(timeout_s), self._loop).result()

    def session(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Route the requests generated meanwhile by session ``key`` (the affinity of
        ``RouterPolicy.SESSION``): ``with pool_backend(engine).session("user-1"): engine.generate(...)``."""
        return self._data.session(key)

    def routed_to(self, replicas: Sequence[int]) -> contextlib.AbstractContextManager[None]:
        """Route the requests generated meanwhile over ``replicas`` only (a bench measuring k
        replicas against all of them on the same pool); the pool's state is not changed."""
        return self._data.routed_to(replicas)

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Generate on the replicas: ``n`` completions per request, in request order, then index."""
        return await self._data.generate(requests)

    @hookimpl
    def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream one request from one replica (:meth:`DataPlane.generate_stream`)."""
        return self._data.generate_stream(request)

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (``None``: all in flight on every replica) where they were routed."""
        await self._data.abort(request_ids)

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The engine's native generate on the least loaded replica (no rlinfer conversion)."""
        return await self._data.bench_raw_generate(requests)

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Load ``update`` on every replica, all or nothing from the trainer's view (:mod:`rlinfer_ray.control`)."""
        await self._control.update_weights(update)

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Every replica's workers join ONE group with the trainer (:meth:`ControlPlane.init_weight_broadcast`)."""
        await self._control.init_weight_broadcast(group)

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """Pause every serving replica (a replica restarted meanwhile is paused as it re-syncs)."""
        await self._control.pause(mode)

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """Resume every serving replica."""
        await self._control.resume()

    @hookimpl
    async def rlinfer_stage_weights(self, staging_id: str, update: WeightUpdate) -> None:
        """Stage one part on every replica; on any failure the staging is cancelled on all of them."""
        await self._staging.stage(staging_id, update)

    @hookimpl
    async def rlinfer_commit_staged_weights(self, staging_id: str, version: int) -> None:
        """Load the staged weights on every replica that staged them, as an update is loaded."""
        await self._staging.commit(staging_id, version)

    @hookimpl
    async def rlinfer_cancel_staged_weights(self, staging_id: str) -> None:
        """Every replica drops what it staged."""
        await self._staging.cancel(staging_id)

    # --- fan-out hooks -------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums of the served weights; every serving replica must report the same ones."""
        timeout = self.config.request_timeout_s
        results = await self._control.call_all("rlinfer_weights_checksum", self.replicas.serving(), timeout=timeout)
        per = {i: res for i, res in results.items() if not isinstance(res, BaseException)}
        if not per:
            raise EngineDead("no replica of the pool is serving")
        first: Mapping[str, WeightChecksum] = per[min(per)]
        differ = [i for i, sums in per.items() if sums != first]
        if differ:
            raise WeightUpdateError(f"replicas {differ} serve other weights than replica {min(per)}")
        return first

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag], discard_weights: bool = False) -> None:
        """Release ``tags`` on every replica (``discard_weights`` never comes: :data:`POOL_UNSUPPORTED`)."""
        if discard_weights:
            raise InvalidRequest("discard_weights", POOL_UNSUPPORTED[Capability.MEMORY_DISCARD_WEIGHTS])
        await self._control.call_all("rlinfer_release_memory", self.replicas.serving(), tags, timeout=300.0)

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """Resume ``tags`` on every replica."""
        await self._control.call_all("rlinfer_resume_memory", self.replicas.serving(), tags, timeout=300.0)

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """Drop cached prefixes on every replica."""
        await self._control.call_all("rlinfer_reset_prefix_cache", self.replicas.serving())

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """Every replica's own reload from a safetensors directory (unversioned bench baseline)."""
        await self._control.call_all(
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
        timeout = self.config.request_timeout_s
        results = await self._control.call_all(method, self.replicas.serving(), *args, timeout=timeout)
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
    backend_object = PoolBackend(info, config, pool or PoolConfig())
    return await AsyncEngine._open_backend(info, backend_object, config, plugins, extra)


def open_pool(
    backend: str, config: EngineConfig | None = None, *, pool: PoolConfig | None = None, **kwargs: Any
) -> Engine:
    """Start a pool (see :func:`open_async_pool`) behind a blocking :class:`Engine` on its own loop thread."""
    from rlinfer_core.engine import Engine

    return Engine._open_on_loop(lambda: open_async_pool(backend, config, pool=pool, **kwargs), "rlinfer-pool-loop")


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
