"""Weights through SGLang's scheduler, over either transport: updates, checksums, broadcast
groups, and the prefix cache they make stale.

Every weight source goes to rlinfer's scheduler-side loader (:mod:`rlinfer_sglang.scheduler.loader`)
through SGLang's ``update_weights_from_tensor`` (inside ``begin_weight_update`` /
``end_weight_update`` where SGLang has them); the loader reads and checks everything before
loading and writes its outcome to a file per TP rank. :class:`Weights` owns those files, the served
specs, the broadcast group's name and the arena CUDA tensors are packed into.

Sequencing where the transport salts (in process): every request carries its weight version's
radix-cache key (:func:`rlinfer_sglang.requests.cache_key`), so an update flushes nothing and
waits for no request to finish. New requests wait at the backend's gate, those admitted before
it closed reach the scheduler first, the scheduler pauses in place (requests keep their KV;
"retract" where it overlaps steps) for the load, and the loader gives every request without KV
the new key; then generation goes on. Elsewhere (over HTTP): new requests wait at the gate,
requests in flight are retracted (they keep
their tokens; unless the caller paused already) for the load and continue after it, so the update
lands between engine steps, as on vLLM; the new version is labelled before anything runs again.
An SGLang without begin/end (0.5.16; ``Transport.begin_end``) flushes its cache only when no
request is pending, a retracted one included, and its scheduler dies when the flush inside an
update fails: there an update with requests running waits for them (SGLang's own semantics),
and the flush goes outside the update.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import attrs

from rlinfer_core.errors import BackendLoadError, InvalidRequest, RLInferError, WeightUpdateError
from rlinfer_core.transfer.arena import PackArena, engine_arena
from rlinfer_core.types import Capabilities, Capability, EngineConfig
from rlinfer_core.weights import (
    BroadcastGroup,
    BroadcastSource,
    Bucket,
    Buckets,
    CheckpointDir,
    NamedTensors,
    TensorSpec,
    WeightUpdate,
)
from rlinfer_sglang import requests as bodies
from rlinfer_sglang.capabilities import Platform
from rlinfer_sglang.inflight import InFlight
from rlinfer_sglang.pausing import Pausing
from rlinfer_sglang.transport import Served, Transport

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum

logger = logging.getLogger(__name__)

#: how long a flush on an SGLang without begin/end waits for running requests (the facade gives
#: ``reset_prefix_cache`` 60 s)
FLUSH_WAIT_S = 50.0
#: how long the flush right after an idle update waits for the scheduler's last batch to clear
IDLE_FLUSH_WAIT_S = 5.0
#: how long a salted update waits for the requests admitted before it to reach the scheduler
SEND_WAIT_S = 30.0


@attrs.define(eq=False)
class Weights:
    """Weight specs, updates over every weight source, broadcast groups, checksums, prefix cache."""

    _config: EngineConfig
    _platform: Platform
    _transport: Transport
    _flight: InFlight
    _pausing: Pausing
    _capabilities: Callable[[], Capabilities]
    #: the served parameters (the checkpoint's names and shapes, in the engine's dtype)
    specs: dict[str, TensorSpec] = attrs.field(factory=dict, init=False)
    #: where the scheduler-side loader writes its outcome, a file per TP rank
    _result_dir: Path = attrs.field(factory=lambda: Path(tempfile.mkdtemp(prefix="rlinfer-sglang-")), init=False)
    _group_name: str = attrs.field(default="", init=False)
    #: the buffers CUDA tensors are packed into for the scheduler, reused while the layout stays
    _ipc_arena: PackArena = attrs.field(factory=engine_arena, init=False)
    #: the cache key of the version an update in progress loads (salting transports only)
    _update_key: str | None = attrs.field(default=None, init=False)
    #: a salted update found requests that SGLang's pause keeps from its scheduler: it flushes
    _late_requests: bool = attrs.field(default=False, init=False)

    def started(self, served: Served) -> None:
        """Read the served parameters' names and shapes from the checkpoint ``served`` names."""
        from rlinfer_core.transfer.disk import read_specs

        # SGLang casts what it loads to the served dtype. With dtype="auto" (where SGLang may serve
        # a float32 checkpoint in float16) the checkpoint's own dtypes are what a trainer holds and
        # what a checkpoint directory contains; with an explicit dtype, that dtype.
        try:
            found = read_specs(served.model_dir)
        except RLInferError as exc:
            raise BackendLoadError(f"cannot read the parameter names of {self._config.model!r}: {exc}") from exc
        self.specs = {n: TensorSpec(n, served.served_dtype or s.dtype, s.shape) for n, s in found.items()}

    async def close(self) -> None:
        """Have the scheduler unmap the arena's buffers; remove the outcome directory."""
        await self._ipc_arena.close(lambda: self.scheduler_op({"op": "release_mapped"}, flush=False))
        shutil.rmtree(self._result_dir, ignore_errors=True)

    def _cache_stale(self) -> bool:
        """SGLang's cache may hold what older weights computed: a request ran since the last
        flush, or one is running (it keeps adding to the cache after a flush)."""
        return self._flight.cache_dirty or self._flight.active > 0

    async def scheduler_op(
        self,
        control: dict[str, Any],
        tensors: Sequence[tuple[str, Any]] = (),
        *,
        flush: bool,
        before_send: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Run rlinfer's scheduler-side loader once on every TP rank; raise on any failure.

        Returns TP rank 0's outcome. ``before_send`` runs right before the update message leaves.
        ``flush``: the op loads weights, so what older weights cached must not be matched again:
        flushed, or (salting) requests without KV take the new version's key.
        """
        from rlinfer_sglang.scheduler.loader import encode_control

        transport, flight = self._transport, self._flight
        transport.alive()
        result = self._result_dir / uuid.uuid4().hex
        if flush and self._update_key is not None:  # salted: nothing older weights cached matches
            control, flush = {**control, "rekey": self._update_key}, False
        payloads = await transport.serialize([encode_control({**control, "result": str(result)}), *tensors])
        flush = flush and self._cache_stale()  # else nothing the old weights cached
        deferred = flush and self._transport.flush_needs_idle
        if deferred:  # flushed after the load, or at the facade's reset
            flush = False
        if transport.begin_end:
            ok, message = await transport.begin_update()
            if not ok:
                raise WeightUpdateError(f"SGLang refused to open a weight update: {message}")
        end_ok, end_message = True, ""
        try:
            ok, message = await transport.update_tensors(payloads, flush, before_send)
        finally:
            if transport.begin_end:
                end_ok, end_message = await transport.end_update()
        outcomes = [self._outcome(result, rank) for rank in range(transport.tp_size)]
        logger.debug("weight op %s: scheduler outcomes %s", control["op"], outcomes)
        failed = [o for o in outcomes if not o.get("ok")]
        if failed:
            problems = tuple(str(o.get("error")) for o in failed)
            if any(o.get("loaded") for o in failed):
                raise WeightUpdateError(
                    "SGLang failed while loading; the engine may hold a partial update: reload a full checkpoint",
                    problems,
                )
            raise WeightUpdateError(f"{control['op']} update rejected before loading", problems)
        if not ok and flush:
            flight.cache_dirty = True  # loaded, but the flush was refused (requests held): at reset
        elif not ok:
            raise WeightUpdateError(f"SGLang failed the update: {message}")
        elif flush:
            flight.cache_dirty = flight.active > 0  # running requests keep adding to the cache
        elif deferred:
            flight.cache_dirty = True
        if not end_ok:
            raise WeightUpdateError(f"SGLang failed to finish the weight update: {end_message}")
        return outcomes[0]

    def _outcome(self, result: Path, rank: int) -> dict[str, Any]:
        path = Path(f"{result}.{rank}")
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._transport.alive()
            return {"ok": False, "loaded": True, "error": f"TP rank {rank} reported no outcome"}
        finally:
            path.unlink(missing_ok=True)
        return data

    @contextlib.asynccontextmanager
    async def _paused_while_running(self, mode: str) -> AsyncIterator[None]:
        """SGLang paused in ``mode`` for the block where requests run and it is not paused already."""
        hold = self._flight.active > 0 and not self._pausing.paused
        if hold:
            await self._transport.pause(mode)
        try:
            yield
        finally:
            if hold:
                await asyncio.shield(self._transport.unpause())

    @contextlib.asynccontextmanager
    async def _quiet_scheduler(self) -> AsyncIterator[None]:
        """Nothing runs in the scheduler for the block: new requests wait at the gate, requests in
        flight are retracted (they keep their tokens) unless SGLang is paused already."""
        async with self._flight.gate_closed(), self._paused_while_running("retract"):
            yield

    @contextlib.asynccontextmanager
    async def _idle_scheduler(self) -> AsyncIterator[None]:
        """For an SGLang without begin/end: new requests wait at the gate and the block runs once
        the requests in flight finished (bounded by ``request_timeout_s``; nothing is loaded when
        they do not finish in time)."""
        async with self._flight.gate_closed():
            timeout = self._config.request_timeout_s
            try:
                await self._transport.guard(asyncio.wait_for(self._flight.idle.wait(), timeout=timeout))
            except TimeoutError as exc:
                self._transport.alive()
                raise WeightUpdateError(
                    f"the requests in flight did not finish within {timeout:.0f} s; nothing was loaded "
                    "(this SGLang loads only between requests: pause(abort) first)"
                ) from exc
            yield

    @contextlib.asynccontextmanager
    async def _held_scheduler(self) -> AsyncIterator[None]:
        """For a salting transport: new requests wait at the gate, the samples admitted before it
        closed reach the scheduler (so the loader sees them), and SGLang pauses (``update_pause``)
        for the block; no request in flight has to finish."""
        flight, transport = self._flight, self._transport
        async with flight.gate_closed():
            await self._pausing.drain_scoring()
            deadline = time.monotonic() + SEND_WAIT_S
            paused = self._pausing.paused
            self._late_requests = False
            while unsent := transport.unsent(flight.all_rids()):
                if paused:  # they reach the scheduler after the load, with the old key: flushed
                    self._late_requests = True
                    break
                if time.monotonic() >= deadline:
                    raise WeightUpdateError(
                        f"{len(unsent)} requests did not reach SGLang's scheduler within {SEND_WAIT_S:.0f} s; "
                        "nothing was loaded"
                    )
                await transport.guard(asyncio.sleep(0.002))
            async with self._paused_while_running(transport.update_pause):
                yield

    def _quiet(self) -> contextlib.AbstractAsyncContextManager[None]:
        if self._transport.salts:
            return self._held_scheduler()
        running = self._flight.active > 0 and not self._pausing.paused
        return self._idle_scheduler() if running and self._transport.flush_needs_idle else self._quiet_scheduler()

    async def update(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the scheduler, which checks all of it, then loads; then
        label the new version while nothing runs."""
        flight = self._flight
        version = update.version if update.version is not None else flight.versions.current + 1
        in_flight: list[str] = []
        dispatched: set[str] = set()

        def snapshot() -> None:
            # samples SGLang's scheduler had been sent before the update (see versions.py)
            in_flight.extend(flight.all_rids())
            dispatched.update(self._transport.dispatched(in_flight, flight.received))

        salted = self._transport.salts
        async with self._pausing.lock, self._quiet():
            salted = salted and not self._late_requests
            self._update_key = bodies.cache_key(version) if salted else None
            try:
                outcome = await self._load(update, snapshot)
            finally:
                self._update_key = None
            ok, message = await self._transport.label(version)
            if not ok:
                raise WeightUpdateError(f"SGLang loaded the update but refused its version label: {message}")
            lengths = outcome.get("lengths")
            if lengths is None:
                logger.warning("the scheduler did not report request lengths; in-flight tokens keep the old version")
                lengths, dispatched = {}, set(in_flight)
            flight.versions.loaded(version, in_flight, dispatched, lengths)
            if not salted and flight.cache_dirty and self._transport.flush_needs_idle and flight.active == 0:
                # flushed while new requests still wait at the gate (the facade's reset, after it
                # opens, could find requests pending, which this SGLang does not flush under)
                await self._flush(IDLE_FLUSH_WAIT_S)

    async def _load(self, update: WeightUpdate, snapshot: Callable[[], None]) -> dict[str, Any]:
        from rlinfer_core.transfer import ipc

        source = update.source
        control: dict[str, Any]
        started = time.perf_counter()
        # into the engine's arena: the same buffers every update of one layout, so the scheduler
        # maps nothing new (it keeps what it mapped: scheduler.loader). Reuse is safe because
        # updates are serialized (the facade's weight lock, Pausing.lock) and the loader copies out
        # of the buffers and synchronizes before the call returns; a call that does not return
        # makes the arena forget them (sending).
        arena = self._ipc_arena
        cuda_buckets = (
            ipc.pack_cuda(source.tensors, arena=arena, check_values=True) if isinstance(source, NamedTensors) else None
        )
        # exhaustive: a new WeightSource type is a mypy error here until it is handled
        match source:
            case NamedTensors() if cuda_buckets is not None:
                pack_s = time.perf_counter() - started
                with arena.sending():
                    outcome = await self._send_buckets(cuda_buckets, snapshot, keep_mapped=arena.keep)
                # as the vLLM backend's line (the GPU bench reads the dict): *_s figures in ms
                timings = {"pack_s": pack_s, "buckets": len(cuda_buckets), **outcome}
                logger.debug(
                    "weight update: %.1f ms packing; scheduler: %s",
                    pack_s * 1e3,
                    {k: round(v * 1e3, 2) if k.endswith("_s") else v for k, v in timings.items() if k != "lengths"},
                )
                return outcome
            case NamedTensors():
                return await self.scheduler_op(
                    {"op": "tensors"}, list(source.tensors), flush=True, before_send=snapshot
                )
            case Buckets():
                return await self._send_buckets(source.buckets, snapshot)
            case CheckpointDir():
                control = {"op": "disk", "path": str(Path(source.path).resolve())}
                return await self.scheduler_op(control, flush=True, before_send=snapshot)
            case BroadcastSource():
                specs = [(s.name, s.dtype, list(s.shape)) for s in source.specs]
                control = {"op": "broadcast", "group_name": self._group_name, "specs": specs}
                return await self.scheduler_op(control, flush=True, before_send=snapshot)
            case _:
                assert_never(source)

    async def _send_buckets(
        self, buckets: Sequence[Bucket], before_send: Callable[[], None], keep_mapped: bool = False
    ) -> dict[str, Any]:
        """``keep_mapped``: the scheduler keeps CUDA buckets mapped until the next update (the
        arena reuses them, see scheduler.loader)."""
        manifests = [attrs.asdict(b.manifest) for b in buckets]
        pairs = [(str(i), b.data) for i, b in enumerate(buckets)]
        control = {"op": "buckets", "manifests": manifests, "keep": keep_mapped}
        return await self.scheduler_op(control, pairs, flush=True, before_send=before_send)

    async def checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums computed in the scheduler over the served parameters, by HF name."""
        from rlinfer_sglang.scheduler.loader import served_checksums

        self._capabilities().require(Capability.WEIGHTS_CHECKSUM)
        specs = [[name, list(spec.shape)] for name, spec in self.specs.items()]
        if "lm_head.weight" not in self.specs and "model.embed_tokens.weight" in self.specs:
            specs.append(["lm_head.weight", list(self.specs["model.embed_tokens.weight"].shape)])
        outcome = await self.scheduler_op({"op": "checksum", "specs": specs}, flush=False)
        return served_checksums(outcome)

    async def join_broadcast(self, group: BroadcastGroup) -> None:
        """Have every scheduler rank join the trainer's group (blocks until all ranks joined)."""
        tp_size = self._transport.tp_size
        if self._platform == "cpu" and group.backend != "gloo":
            raise InvalidRequest("backend", "SGLang on CPU joins gloo groups only")
        if group.rank_offset + tp_size > group.world_size:  # a pool puts several engines in one group
            raise InvalidRequest(
                "world_size",
                f"must hold rank_offset ({group.rank_offset}) + {tp_size} engine ranks, got {group.world_size}",
            )
        try:
            await self.scheduler_op({"op": "join", "group": attrs.asdict(group)}, flush=False)
        except WeightUpdateError as exc:
            raise RLInferError(f"the SGLang scheduler could not join the weight group: {exc}") from exc
        self._group_name = group.group_name

    async def reset_prefix_cache(self) -> None:
        """Flush SGLang's cache; running requests are retracted (recomputed) if they hold any."""
        transport = self._transport
        transport.alive()
        if not self._cache_stale():
            return
        if await self._flush():
            return
        if self._pausing.paused:
            raise RLInferError("SGLang refused to flush its cache while paused")
        if self._transport.flush_needs_idle:
            # this SGLang does not flush while a retracted request is pending: new requests wait
            # at the gate and SGLang flushes once the running ones finished (its deferred flush)
            async with self._flight.gate_closed():
                if not await self._flush(FLUSH_WAIT_S):
                    raise RLInferError(
                        f"SGLang refused to flush its cache: requests still ran after {FLUSH_WAIT_S:.0f} s"
                    )
            return
        await transport.pause("retract")
        try:
            flushed = await self._flush()
        finally:
            await asyncio.shield(transport.unpause())
        if not flushed:
            raise RLInferError("SGLang refused to flush its cache")

    async def _flush(self, wait_s: float = 0.0) -> bool:
        """Flush SGLang's cache; ``wait_s`` > 0: as soon as it is idle, within that time (then
        nothing ran at the flush)."""
        flushed = await self._transport.flush(wait_s)
        if flushed:  # else running requests keep adding to the cache
            self._flight.cache_dirty = self._flight.active > 0 and wait_s == 0
        return flushed
