"""The pool's data plane: routing, per-replica batches, retries on replica death, streams, aborts.

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
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import attrs

from rlinfer_core.errors import EngineDead, EngineTimeout, InvalidRequest
from rlinfer_core.preflight import as_batch, validate_request
from rlinfer_core.types import Capability, Completion, CompletionDelta, GenerateRequest
from rlinfer_ray.control import ControlPlane
from rlinfer_ray.replica import is_replica_death
from rlinfer_ray.replicas import Replica, death_message, raise_dead

if TYPE_CHECKING:
    from rlinfer_core.admission import Admission
    from rlinfer_core.model_info import ModelInfo
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


class DataPlane(ControlPlane):
    """Generation, streaming and aborts of :class:`~rlinfer_ray.pool.EnginePool` (its base class)."""

    router: Router
    model_info: ModelInfo | None
    _admission: Admission
    #: caller request id -> (replica, the id that replica knows it by) while in flight
    _routes: dict[str, set[tuple[int, str]]]

    def replica_states(self) -> list[str]:
        """State of each replica, by index."""
        return [r.state.value for r in self.replicas.replicas]

    async def generate(
        self, requests: GenerateRequest | Sequence[GenerateRequest], *, session: Session = None
    ) -> list[Completion]:
        """Generate on the replicas: ``n`` completions per request, in request order, then index.

        ``session``: a key (or one per request) for the session policy's affinity.
        """
        return await self._generate(requests, session, None)

    async def generate_over_sampled(
        self, requests: GenerateRequest | Sequence[GenerateRequest], over_sample_rate: float
    ) -> list[Completion]:
        """:meth:`generate`, returning once ``ceil(over_sample_rate * len(requests))`` requests have
        finished: the others are aborted (see :mod:`rlinfer_core.over_sample`)."""
        from rlinfer_core.over_sample import generate_over_sampled

        return await generate_over_sampled(self, requests, over_sample_rate, self._caps(), self._check_request)

    async def _generate(
        self,
        requests: GenerateRequest | Sequence[GenerateRequest],
        session: Session,
        members: Sequence[int] | None,
    ) -> list[Completion]:
        batch = as_batch(requests, self._check_request)
        sessions = self._sessions(session, len(batch))
        if not batch:
            return []
        started = time.perf_counter()
        ids = [r.request_id for r in batch]
        async with self._admission.admit(ids, self.config.request_timeout_s):
            plan = self._plan(batch, sessions, members)
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
        """The facade's checks, once here, before anything is routed (each replica checks again)."""
        self._ensure_open()
        validate_request(request, self._caps(), self._released, self.model_info)

    def _candidates(self, members: Sequence[int] | None) -> list[int]:
        candidates = [r.index for r in self.replicas.serving() if members is None or r.index in members]
        if not candidates:
            raise EngineDead(f"no replica of the pool is serving: {self.replica_states()}")
        return candidates

    def _plan(
        self, batch: list[GenerateRequest], sessions: list[str | None], members: Sequence[int] | None = None
    ) -> dict[int, list[_Piece]]:
        """Which replica runs which piece; loads are taken at once."""
        candidates = self._candidates(members)
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

    async def stream(self, request: GenerateRequest, *, session: str | None = None) -> AsyncIterator[CompletionDelta]:
        """Stream one request from one replica. A replica that dies before its first delta is
        replaced (when retry is on); after that the stream ends with EngineDead."""
        self._caps().require(Capability.STREAM)
        self._check_request(request)
        async with self._admission.admit([request.request_id], self.config.request_timeout_s):
            attempt = 0
            while True:
                candidates = self._candidates(None)
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
            self._unroute(request.request_id, route)
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

    # --- benchmarking --------------------------------------------------------------------------

    async def bench_generate_on(self, requests: Sequence[GenerateRequest], replicas: Sequence[int]) -> list[Completion]:
        """:meth:`generate` routed over ``replicas`` only (a bench measuring k replicas against
        all of them on the same pool); the pool's state is not changed."""
        return await self._generate(requests, None, list(replicas))

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The engine's native generate on the least loaded replica (no rlinfer conversion)."""
        self._ensure_open()
        self._caps().require(Capability.BENCH)
        candidates = self._candidates(None)
        index = self.router.pick(candidates, {r.index: r.load for r in self.replicas.replicas})
        replica = self.replicas.replicas[index]
        result: int = await self.replicas.call(
            replica, "bench_raw_generate", list(requests), timeout=self.config.request_timeout_s
        )
        return result
