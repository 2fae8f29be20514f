"""EnginePool: N engine replicas on Ray behind the API of :class:`rlinfer_core.engine.AsyncEngine`.

Data plane: each request (or each sample of an unseeded ``n>1`` request, when spread) goes to
the replica the :class:`~rlinfer_ray.router.Router` picks; completions come back re-indexed in
request order. A replica that dies mid-generate has its requests run again elsewhere (or the
caller gets EngineDead when ``PoolConfig.retry`` is off) and is restarted in the background.

Control plane (pause, weights, memory, cache, health): concurrent fan-out to every replica; see
:mod:`rlinfer_ray.control` for weight updates (all-or-nothing from the trainer's view).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.admission import Admission
from rlinfer_core.errors import EngineDead, EngineTimeout, InvalidRequest
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.observers import Observers
from rlinfer_core.preflight import as_memory_tags, request_capabilities
from rlinfer_core.types import (
    PAUSE_CAPABILITY,
    Capabilities,
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import TensorSpec
from rlinfer_ray.agent import PoolAgent
from rlinfer_ray.config import PoolConfig
from rlinfer_ray.control import ControlPlane
from rlinfer_ray.replica import is_replica_death
from rlinfer_ray.replicas import Replica, ReplicaSet, State, death_message, raise_dead
from rlinfer_ray.router import Router

#: slack over request_timeout_s for a replica's generate reply (its own facade times out first)
REPLY_SLACK_S = 30.0

Session = str | Sequence[str | None] | None


@attrs.define(eq=False)
class _Piece:
    """Part of one caller request, sent to one replica."""

    position: int  #: index of the caller's request in the batch
    request_id: str  #: the caller's id
    offset: int  #: first sample index of this piece in the caller's request
    sub: GenerateRequest  #: what the replica gets


class EnginePool(PoolAgent, ControlPlane):
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
        self.capabilities = infos[0]["capabilities"]
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

    def replica_states(self) -> list[str]:
        """State of each replica, by index."""
        return [r.state.value for r in self.replicas.replicas]

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

    def _ensure_open(self) -> None:
        if self._closed:
            raise EngineDead(f"engine pool of {self.backend_name!r} was shut down; open a new one")

    def _caps(self) -> Capabilities:
        assert self.capabilities is not None
        return self.capabilities

    # --- data plane ----------------------------------------------------------------------------

    async def generate(
        self, requests: GenerateRequest | Sequence[GenerateRequest], *, session: Session = None
    ) -> list[Completion]:
        """Generate on the replicas: ``n`` completions per request, in request order, then index.

        ``session``: a key (or one per request) for the session policy's affinity.
        """
        batch = [requests] if isinstance(requests, GenerateRequest) else list(requests)
        sessions = self._sessions(session, len(batch))
        for request in batch:
            self._check_request(request)
        if len({r.request_id for r in batch}) != len(batch):
            raise InvalidRequest("request_id", "request ids in one batch must be unique")
        if not batch:
            return []
        started = time.perf_counter()
        ids = [r.request_id for r in batch]
        async with self._admission.admit(ids, self.config.request_timeout_s):
            plan = self._plan(batch, sessions)
            parts = await asyncio.gather(*(self._run(index, pieces, 0) for index, pieces in plan.items()))
        out = sorted((c for part in parts for c in part), key=lambda pc: (pc[0], pc[1].index))
        completions = [c for _, c in out]
        self._observers.emit(
            "rlinfer_on_generate_done",
            backend=self.backend_name,
            requests=batch,
            completions=completions,
            seconds=time.perf_counter() - started,
        )
        return completions

    def _sessions(self, session: Session, count: int) -> list[str | None]:
        if session is None or isinstance(session, str):
            return [session] * count
        keys = list(session)
        if len(keys) != count:
            raise InvalidRequest("session", f"must be one key or one per request ({count}), got {len(keys)}")
        return keys

    def _check_request(self, request: GenerateRequest) -> None:
        self._ensure_open()
        if not isinstance(request, GenerateRequest):
            raise InvalidRequest("requests", f"must be GenerateRequest objects, got {type(request).__name__}")
        for capability in request_capabilities(request):
            self._caps().require(capability)
        if MemoryTag.KV_CACHE in self._released or MemoryTag.WEIGHTS in self._released:
            raise InvalidRequest(
                "engine_state", f"memory {sorted(self._released)} is released; call resume_memory() first"
            )

    def _plan(self, batch: list[GenerateRequest], sessions: list[str | None]) -> dict[int, list[_Piece]]:
        """Which replica runs which piece; loads are taken at once."""
        candidates = [r.index for r in self.replicas.serving()]
        if not candidates:
            raise EngineDead(f"no replica of the pool is serving: {self.replica_states()}")
        loads = {r.index: r.load for r in self.replicas.replicas}
        plan: dict[int, list[_Piece]] = {}
        for position, (request, key) in enumerate(zip(batch, sessions, strict=True)):
            n = request.sampling.n
            spread = self.pool_config.spread_n and n > 1 and request.sampling.seed is None and len(candidates) > 1
            shares = self.router.spread(candidates, loads, n, key) if spread else {}
            if len(shares) <= 1:
                index = next(iter(shares)) if shares else self.router.pick(candidates, loads, n, key)
                pieces = [(index, _Piece(position, request.request_id, 0, request))]
            else:
                pieces, offset = [], 0
                for index, count in sorted(shares.items()):
                    sub = attrs.evolve(
                        request,
                        request_id=f"{request.request_id}/{offset}",
                        sampling=attrs.evolve(request.sampling, n=count),
                    )
                    pieces.append((index, _Piece(position, request.request_id, offset, sub)))
                    offset += count
            for index, piece in pieces:
                loads[index] += piece.sub.sampling.n
                plan.setdefault(index, []).append(piece)
        return plan

    async def _run(self, index: int, pieces: list[_Piece], attempt: int) -> list[tuple[int, Completion]]:
        """Run ``pieces`` on replica ``index``; on its death, again elsewhere (bounded)."""
        replica = self.replicas.replicas[index]
        cost = sum(p.sub.sampling.n for p in pieces)
        routes = [(p.request_id, (index, p.sub.request_id)) for p in pieces]
        replica.load += cost
        for rid, route in routes:
            self._routes.setdefault(rid, set()).add(route)
        try:
            completions = await self.replicas.call(
                replica, "generate", [p.sub for p in pieces], timeout=self.config.request_timeout_s + REPLY_SLACK_S
            )
        except Exception as exc:
            if not is_replica_death(exc):
                raise
            self._replica_failed(replica, exc)
            if not self.pool_config.retry or attempt >= self.pool_config.max_retries:
                raise_dead(replica, exc)
            others = [r.index for r in self.replicas.serving(exclude=index)]
            if not others:
                raise EngineDead(f"{death_message(replica, exc)}; no other replica is serving") from exc
            loads = {r.index: r.load for r in self.replicas.replicas}
            return await self._run(self.router.pick(others, loads, cost), pieces, attempt + 1)
        finally:
            replica.load -= cost
            for rid, route in routes:
                left = self._routes.get(rid)
                if left is not None:
                    left.discard(route)
                    if not left:
                        del self._routes[rid]
        replica.served += len(pieces)
        by_sub = {p.sub.request_id: p for p in pieces}
        out = []
        for c in completions:
            piece = by_sub[c.request_id]
            out.append((piece.position, attrs.evolve(c, request_id=piece.request_id, index=piece.offset + c.index)))
        return out

    async def stream(self, request: GenerateRequest, *, session: str | None = None) -> AsyncIterator[CompletionDelta]:
        """Stream one request from one replica. A replica that dies before its first delta is
        replaced (when retry is on); after that the stream ends with EngineDead."""
        self._caps().require(Capability.STREAM)
        self._check_request(request)
        async with self._admission.admit([request.request_id], self.config.request_timeout_s):
            attempt = 0
            while True:
                candidates = [r.index for r in self.replicas.serving()]
                if not candidates:
                    raise EngineDead(f"no replica of the pool is serving: {self.replica_states()}")
                loads = {r.index: r.load for r in self.replicas.replicas}
                replica = self.replicas.replicas[self.router.pick(candidates, loads, request.sampling.n, session)]
                yielded = False
                try:
                    async for delta in self._stream_on(replica, request):
                        yielded = True
                        yield delta
                    return
                except Exception as exc:
                    if not is_replica_death(exc):
                        raise
                    self._replica_failed(replica, exc)
                    attempt += 1
                    if yielded or not self.pool_config.retry or attempt > self.pool_config.max_retries:
                        raise_dead(replica, exc)

    async def _stream_on(self, replica: Replica, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        import ray

        from rlinfer_ray.replica import unpack_error

        route = (replica.index, request.request_id)
        self._routes.setdefault(request.request_id, set()).add(route)
        replica.load += request.sampling.n
        refs = replica.actor.stream.options(num_returns="streaming").remote(request)
        deadline = time.monotonic() + self.config.request_timeout_s + REPLY_SLACK_S
        try:
            while True:
                try:
                    ref = await asyncio.wait_for(anext(refs), timeout=max(deadline - time.monotonic(), 0.001))
                    status, value = await asyncio.wait_for(ref, timeout=max(deadline - time.monotonic(), 0.001))
                except StopAsyncIteration:
                    replica.served += 1
                    return
                except TimeoutError:
                    raise EngineTimeout(
                        f"replica {replica.index}: stream of {request.request_id!r} timed out"
                    ) from None
                if status == "err":
                    raise unpack_error(value, f"replica {replica.index}: ")
                yield value
        finally:
            replica.load -= request.sampling.n
            self._routes.get(request.request_id, set()).discard(route)
            if not self._routes.get(request.request_id, True):
                del self._routes[request.request_id]
            with contextlib.suppress(Exception):
                ray.cancel(refs)

    async def abort(self, request_ids: Sequence[str] | str | None = None) -> None:
        """Abort requests (``None``: all in flight on every replica); callers get partial tokens."""
        self._ensure_open()
        self._caps().require(Capability.ABORT)
        timeout = self.pool_config.control_timeout_s
        if request_ids is None:
            results = await self.replicas.fan_out(
                self.replicas.serving(),
                lambda r: self.replicas.call_raw(r, r.actor.abort.remote(None), timeout, "abort"),
            )
            self._raise_first(results)
            return
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        per_replica: dict[int, list[str]] = {}
        for rid in ids:
            for index, sub in self._routes.get(rid, ()):
                per_replica.setdefault(index, []).append(sub)
        members = [r for r in self.replicas.serving() if r.index in per_replica]
        results = await self.replicas.fan_out(
            members,
            lambda r: self.replicas.call_raw(r, r.actor.abort.remote(per_replica[r.index]), timeout, "abort"),
        )
        self._raise_first(results)

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause every replica (see PauseMode); new requests wait at the pool until resume()."""
        self._ensure_open()
        try:
            pause_mode = PauseMode(mode)
        except ValueError:
            raise InvalidRequest("mode", f"must be one of {[m.value for m in PauseMode]}, got {mode!r}") from None
        self._caps().require(PAUSE_CAPABILITY[pause_mode])
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

    # --- memory and cache ----------------------------------------------------------------------

    async def release_memory(self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None) -> None:
        """Release memory on every replica (see AsyncEngine.release_memory)."""
        self._ensure_open()
        wanted = as_memory_tags(tags)
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
        wanted = as_memory_tags(tags)
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

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The engine's native generate on the least loaded replica (no rlinfer conversion)."""
        self._ensure_open()
        candidates = [r.index for r in self.replicas.serving()]
        index = self.router.pick(candidates, {r.index: r.load for r in self.replicas.replicas})
        replica = self.replicas.replicas[index]
        result: int = await self.replicas.call(
            replica, "bench_raw_generate", list(requests), timeout=self.config.request_timeout_s
        )
        return result

    async def bench_raw_weight_update(self, path: str) -> None:
        """Every replica's own reload from a safetensors directory (unversioned bench baseline)."""
        self._ensure_open()
        await self._control(
            "bench_raw_weight_update", self.replicas.serving(), path, timeout=self.config.request_timeout_s
        )
