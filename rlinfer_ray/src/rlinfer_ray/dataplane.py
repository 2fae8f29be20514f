"""The pool's data plane (:class:`DataPlane`): routing, per-replica batches, retries, streams, aborts.

Each request (or each sample of an unseeded ``n>1`` request, when spread) goes to the replica
the :class:`~rlinfer_ray.router.Router` picks; a batch is split once per replica (one actor call
per replica, not per request) and the completions come back re-indexed in request order. A
replica that dies mid-generate has its requests run again elsewhere (or the caller gets
EngineDead when ``PoolConfig.retry`` is off) and is restarted in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING

import attrs

from rlinfer_core.errors import EngineDead, EngineTimeout
from rlinfer_core.types import Completion, CompletionDelta, GenerateRequest
from rlinfer_ray.replica import is_replica_death
from rlinfer_ray.replicas import Replica, death_message, raise_dead

if TYPE_CHECKING:
    from rlinfer_core.types import EngineConfig
    from rlinfer_ray.config import PoolConfig
    from rlinfer_ray.control import ControlPlane
    from rlinfer_ray.replicas import ReplicaSet
    from rlinfer_ray.router import Router

#: slack over request_timeout_s for a replica's reply (the facade times out first and aborts)
REPLY_SLACK_S = 30.0


@attrs.define(eq=False)
class _Piece:
    """Part of one caller request, sent to one replica."""

    position: int  #: index of the caller's request in the batch
    request_id: str  #: the caller's id
    offset: int  #: first sample index of this piece in the caller's request
    sub: GenerateRequest  #: what the replica gets


@attrs.define(eq=False)
class DataPlane:
    """Generation, streaming and aborts over the replicas: where each request runs and what is in
    flight where. A replica that dies under a request goes to ``control`` to be restarted."""

    replicas: ReplicaSet
    control: ControlPlane
    router: Router  #: replaced with the pool's (``PoolBackend.router``)
    config: EngineConfig
    pool_config: PoolConfig  #: replaced with the pool's (``PoolBackend.pool_config``)
    #: caller request id -> (replica, the id that replica knows it by) while in flight
    _routes: dict[str, set[tuple[int, str]]] = attrs.field(factory=dict, init=False)
    #: the session key requests are routed by now (see :meth:`session`)
    _session: str | None = attrs.field(default=None, init=False)
    #: the replicas requests are routed to now (see :meth:`routed_to`; None: every serving one)
    _only: list[int] | None = attrs.field(default=None, init=False)

    @contextlib.contextmanager
    def session(self, key: str) -> Iterator[None]:
        """Route the requests generated meanwhile by session ``key`` (``RouterPolicy.SESSION``)."""
        saved, self._session = self._session, key
        try:
            yield
        finally:
            self._session = saved

    @contextlib.contextmanager
    def routed_to(self, replicas: Sequence[int]) -> Iterator[None]:
        """Route the requests generated meanwhile over ``replicas`` only."""
        saved, self._only = self._only, list(replicas)
        try:
            yield
        finally:
            self._only = saved

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Generate on the replicas: ``n`` completions per request, in request order, then index."""
        batch = list(requests)
        plan = self._plan(batch, self._session, self._only)
        parts = await asyncio.gather(*(self._run(index, pieces, 0) for index, pieces in plan.items()))
        out = sorted((c for part in parts for c in part), key=lambda pc: (pc[0], pc[1].index))
        return [c for _, c in out]

    def _candidates(self, members: Sequence[int] | None) -> list[int]:
        candidates = [r.index for r in self.replicas.serving() if members is None or r.index in members]
        if not candidates:
            states = [r.state.value for r in self.replicas.replicas]
            raise EngineDead(f"no replica of the pool is serving: {states}")
        return candidates

    def _plan(
        self, batch: list[GenerateRequest], session: str | None, members: Sequence[int] | None = None
    ) -> dict[int, list[_Piece]]:
        """Which replica runs which piece; loads are taken at once."""
        candidates = self._candidates(members)
        loads = {r.index: r.load for r in self.replicas.replicas}
        plan: dict[int, list[_Piece]] = {}
        for position, request in enumerate(batch):
            n = request.sampling.n
            spread = self.pool_config.spread_n and n > 1 and request.sampling.seed is None and len(candidates) > 1
            shares = self.router.spread(candidates, loads, n, session) if spread else {}
            if len(shares) <= 1:
                index = next(iter(shares)) if shares else self.router.pick(candidates, loads, n, session)
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
                replica,
                "rlinfer_generate",
                [p.sub for p in pieces],
                timeout=self.config.request_timeout_s + REPLY_SLACK_S,
            )
        except Exception as exc:
            if not is_replica_death(exc):
                raise
            self.control.replica_failed(replica, exc)
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
                self._unroute(rid, route)
        replica.served += len(pieces)
        by_sub = {p.sub.request_id: p for p in pieces}
        out = []
        for c in completions:
            piece = by_sub[c.request_id]
            out.append((piece.position, attrs.evolve(c, request_id=piece.request_id, index=piece.offset + c.index)))
        return out

    def _unroute(self, request_id: str, route: tuple[int, str]) -> None:
        left = self._routes.get(request_id)
        if left is not None:
            left.discard(route)
            if not left:
                del self._routes[request_id]

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream one request from one replica; another replaces it if it dies before its first delta."""
        attempt = 0
        while True:
            candidates = self._candidates(self._only)
            loads = {r.index: r.load for r in self.replicas.replicas}
            replica = self.replicas.replicas[self.router.pick(candidates, loads, request.sampling.n, self._session)]
            yielded = False
            try:
                async for delta in self._stream_on(replica, request):
                    yielded = True
                    yield delta
                return
            except Exception as exc:
                if not is_replica_death(exc):
                    raise
                self.control.replica_failed(replica, exc)
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
            self._unroute(request.request_id, route)
            with contextlib.suppress(Exception):
                ray.cancel(refs)

    async def abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (``None``: all in flight on every replica) where they were routed."""
        timeout = self.pool_config.control_timeout_s
        per_replica: dict[int, list[str]] = {}
        for rid in request_ids or ():
            for index, sub in self._routes.get(rid, ()):
                per_replica.setdefault(index, []).append(sub)
        members = [r for r in self.replicas.serving() if request_ids is None or r.index in per_replica]
        results = await self.replicas.fan_out(
            members,  # each aborts its share, or (request_ids None) all it has in flight
            lambda r: self.replicas.call_raw(
                r, r.actor.call.remote("rlinfer_abort", per_replica.get(r.index)), timeout, "abort"
            ),
        )
        self.control.raise_first(results)

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The engine's native generate on the least loaded replica (no rlinfer conversion)."""
        candidates = self._candidates(self._only)
        index = self.router.pick(candidates, {r.index: r.load for r in self.replicas.replicas})
        replica = self.replicas.replicas[index]
        result: int = await self.replicas.call(
            replica, "rlinfer_bench_raw_generate", list(requests), timeout=self.config.request_timeout_s
        )
        return result
