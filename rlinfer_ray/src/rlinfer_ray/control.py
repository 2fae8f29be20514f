"""The pool's control plane (:class:`ControlPlane`): fan-out, weight updates, broadcasts, pause, restarts.

Weight updates are all-or-nothing from the trainer's view:

- the update is validated once, by the facade (``AsyncEngine.update_weights``) against the
  engines' weight specs, before any replica is touched: a bad update (shape, dtype, NaN, corrupt
  bucket, ...) fails on no replica at all;
- it is then sent to every replica at once (named tensors and buckets go into Ray's object
  store once and every replica reads them from there; a checkpoint directory by path; a
  broadcast reaches every replica's workers in one group, see :meth:`ControlPlane.init_weight_broadcast`);
- when every replica rejects it, the error is raised and the pool version stays;
- when some replicas loaded it and others failed, the failed ones leave routing at once, are
  restarted and re-synced to the new weights before they serve again; the pool's version is the
  new one, and every replica that serves serves it. Each completion carries the version (per
  token) of the replica that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core.errors import EngineDead, RLInferError, WeightUpdateError
from rlinfer_core.types import PauseMode
from rlinfer_core.weights import BroadcastGroup, BroadcastSource, Buckets, CheckpointDir, NamedTensors, WeightUpdate
from rlinfer_ray.replica import is_replica_death
from rlinfer_ray.replicas import Replica, State, death_message
from rlinfer_ray.shipping import ShippedWeights

if TYPE_CHECKING:
    from rlinfer_core.types import EngineConfig
    from rlinfer_ray.config import PoolConfig
    from rlinfer_ray.replicas import ReplicaSet

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class ControlPlane:
    """What every replica must agree on: the pool's weight version (and how a restarted replica
    gets it back), the pause in force, the broadcast group; calls fanned out to the replicas, and
    the restarts of the ones that die."""

    replicas: ReplicaSet
    config: EngineConfig
    pool_config: PoolConfig  #: replaced with the pool's (``PoolBackend.pool_config``)
    #: the version the serving replicas serve (what a restarted replica is re-synced to)
    _version: int = attrs.field(default=0, init=False)
    #: the mode of a pause in force (a restarted replica is paused the same way)
    _paused: PauseMode | None = attrs.field(default=None, init=False)
    #: serialises loads, stagings and re-syncs of restarted replicas
    weight_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _restarts: dict[int, asyncio.Task[None]] = attrs.field(factory=dict, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    #: how a restarted replica gets the pool's weights back (None: it cannot; it waits STALE)
    _replay: Any = attrs.field(default=None, init=False)
    #: broadcast group members: replica index -> actor generation that joined
    _group_members: dict[int, int] = attrs.field(factory=dict, init=False)
    #: the last weight update's fan-out: replica index -> seconds from the fan-out's start until
    #: that replica answered (loads that overlap end together; serialised ones one after another)
    last_update_fanout_s: dict[int, float] = attrs.field(factory=dict, init=False)

    async def call_all(
        self, hook: str, members: list[Replica], *args: Any, timeout: float | None = None
    ) -> dict[int, Any]:
        """``hook`` on every member at once; a member that died is restarted, any other error is
        raised (the first, by replica index). ``{index: reply, or the death it met}``."""
        bound = timeout if timeout is not None else self.pool_config.control_timeout_s
        results = await self.replicas.fan_out(members, lambda r: self.replicas.call(r, hook, *args, timeout=bound))
        self.raise_first(results)
        return results

    def raise_first(self, results: Mapping[int, Any]) -> None:
        """After a fan-out: restart the replicas that died, then raise the first other error."""
        failures = {i: res for i, res in sorted(results.items()) if isinstance(res, BaseException)}
        for index, exc in failures.items():
            if is_replica_death(exc):
                self.replica_failed(self.replicas.replicas[index], exc)
        others = [exc for exc in failures.values() if not is_replica_death(exc)]
        if others:
            raise others[0]

    async def pause(self, mode: PauseMode) -> None:
        """Pause every serving replica; a replica restarted meanwhile is paused as it re-syncs."""
        await self.call_all("rlinfer_pause", self.replicas.serving(), mode, timeout=self.config.request_timeout_s)
        self._paused = mode

    async def resume(self) -> None:
        """Resume every serving replica."""
        try:
            await self.call_all("rlinfer_resume", self.replicas.serving())
        finally:
            self._paused = None

    def replica_failed(self, replica: Replica, exc: BaseException) -> None:
        """Take ``replica`` out of routing and restart it in the background (once at a time)."""
        if replica.state in (State.FAILED, State.STOPPED) and replica.index in self._restarts:
            return
        replica.state = State.FAILED
        replica.error = death_message(replica, exc)
        logger.warning("%s; restarting it", replica.error)
        if not self.pool_config.restart or self._closed:
            return
        task = self._restarts.get(replica.index)
        if task is None or task.done():
            self._restarts[replica.index] = asyncio.get_running_loop().create_task(self._restart(replica))

    def close(self) -> None:
        """No restart from now on; the running ones are cancelled."""
        self._closed = True
        for task in list(self._restarts.values()):
            task.cancel()

    async def _restart(self, replica: Replica) -> None:
        """Fresh actor and engine in the same bundle, then re-sync to the pool's weights."""
        try:
            for attempt in range(3):
                await self.replicas.stop(replica, State.FAILED)
                if self._closed:
                    return
                self.replicas.spawn(replica)
                try:
                    await self.replicas.start(replica)
                    await self._resync(replica)
                    replica.restarts += 1
                    return
                except Exception as exc:
                    replica.error = f"restart {attempt + 1} failed: {type(exc).__name__}: {exc}"
                    logger.warning("replica %d: %s", replica.index, replica.error)
            replica.state = State.FAILED
        finally:
            self._restarts.pop(replica.index, None)

    async def _resync(self, replica: Replica) -> None:
        async with self.weight_lock:
            if self._version > 0:
                if self._replay is None:
                    replica.state = State.STALE  # waits for the next update (broadcast: re-init the group)
                    return
                from rlinfer_ray.staging import StagedParts

                if isinstance(self._replay, StagedParts):  # a staged commit of several parts
                    await self._replay.load(self.replicas, replica, self._version, self.config.request_timeout_s)
                else:
                    await self.replicas.load(replica, self._replay, self._version, self.config.request_timeout_s)
            replica.version = self._version
            if self._paused is not None:
                await self.replicas.call(
                    replica, "rlinfer_pause", self._paused, timeout=self.pool_config.control_timeout_s
                )
            replica.state = State.SERVING

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once no restart is running and every replica serves (EngineDead otherwise)."""
        deadline = time.monotonic() + timeout_s
        while self._restarts:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*self._restarts.values(), return_exceptions=True), remaining)
        bad = [r for r in self.replicas.replicas if r.state is not State.SERVING]
        if bad:
            raise EngineDead("replicas not serving: " + "; ".join(f"{r.index}: {r.state} ({r.error})" for r in bad))

    async def update_weights(self, update: WeightUpdate) -> None:
        """Load ``update`` (validated, its version set) on every replica (see the module docstring)."""
        import ray

        assert update.version is not None, "the facade sets the version"
        async with self.weight_lock:
            target, source = update.version, update.source
            if isinstance(source, BroadcastSource):
                members = self._broadcast_members()
                replay: Any = None
                shipped: Any = source
            else:
                members = self.replicas.alive()
                # one copy in Ray's object store, read by every replica (and kept to re-sync restarts),
                # as raw bytes: a pickled tensor costs a copy in and one out per reader (shipping.py)
                shipped = ray.put(ShippedWeights(source)) if isinstance(source, NamedTensors | Buckets) else source
                replay = shipped if isinstance(source, NamedTensors | Buckets | CheckpointDir) else None
            if not members:
                raise EngineDead(
                    f"no replica of the pool can take weights: {[r.state.value for r in self.replicas.replicas]}"
                )
            fanned = time.perf_counter()
            answered: dict[int, float] = {}

            async def load(r: Replica) -> Any:
                try:
                    return await self.replicas.load(r, shipped, target, self.config.request_timeout_s)
                finally:
                    answered[r.index] = time.perf_counter() - fanned

            results = await self.replicas.fan_out(members, load)
            self.last_update_fanout_s = answered
            logger.debug("update to version %d: replicas answered after %s s", target, answered)
            self.settle(results, target, "no replica loaded the update", replay)

    def settle(self, results: Mapping[int, Any], target: int, nobody: str, replay: Any) -> None:
        """After a load fanned out under :attr:`weight_lock` (an update or a staged commit): when any
        replica loaded it, ``target`` is the pool's version and ``replay`` how a restarted replica gets
        it (the failed ones leave routing and are restarted, re-synced to it); when none did, the first
        typed error is raised and the version stays."""
        loaded = [self.replicas.replicas[i] for i, res in results.items() if not isinstance(res, BaseException)]
        failed = {i: res for i, res in results.items() if isinstance(res, BaseException)}
        if not loaded:
            for i, exc in failed.items():
                if is_replica_death(exc):
                    self.replica_failed(self.replicas.replicas[i], exc)
            raise first_error(failed, nobody)
        self._version, self._replay = target, replay
        for r in loaded:
            r.version = target
            if r.state is State.STALE:
                r.state = State.SERVING
        for i, exc in failed.items():
            # out of routing now; the restart re-syncs it to `target` once the weight lock is released
            self.replica_failed(self.replicas.replicas[i], exc)

    def _broadcast_members(self) -> list[Replica]:
        members = [r for r in self.replicas.alive() if self._group_members.get(r.index) == r.generation]
        changed = [r.index for r in self.replicas.replicas if r.index in self._group_members] != [
            r.index for r in members
        ]
        if not self._group_members:
            raise WeightUpdateError("no broadcast group: call init_weight_broadcast(group) first")
        if changed or len(members) != len(self._group_members):
            raise WeightUpdateError(
                "a replica of the broadcast group was restarted since init_weight_broadcast; call "
                "init_weight_broadcast again with a new group (the restarted replica waits out of routing)"
            )
        return members

    async def init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have every live replica's workers join ONE group with the trainer (rank 0): replica k takes
        ranks ``group.rank_offset + k * world_size`` onwards, so one broadcast reaches every replica."""
        members = self.replicas.alive()
        self._group_members = {}
        offsets = {r.index: group.rank_offset + k * self.config.world_size for k, r in enumerate(members)}
        results = await self.replicas.fan_out(
            members,
            lambda r: self.replicas.call(
                r,
                "rlinfer_init_weight_broadcast",
                attrs.evolve(group, rank_offset=offsets[r.index]),
                timeout=group.timeout_s + 60.0,
            ),
        )
        self.raise_first(results)
        self._group_members = {r.index: r.generation for r in members}


def first_error(failed: Mapping[int, BaseException], message: str) -> BaseException:
    """The error a caller gets when no replica did what was asked: the first typed one (lowest
    replica index) that is not a replica's death, else a WeightUpdateError naming every failure."""
    for index in sorted(failed):
        exc = failed[index]
        if isinstance(exc, RLInferError) and not is_replica_death(exc):
            return exc
    return WeightUpdateError(message, tuple(f"replica {i}: {exc}" for i, exc in sorted(failed.items())))
