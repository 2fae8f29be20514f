"""Staged weight updates over the pool (capability ``weights.staged``): :class:`PoolStaging`, for
the backend's stage, commit and cancel hooks. The handle, its validation (names staged twice, the
bound ``EngineConfig.max_staged_weight_bytes``) and the version are the facade's
(:mod:`rlinfer_core.engine_staging`, :mod:`rlinfer_core.staging`); here: stage on every
replica, commit on all or none.

- Each part is put into Ray's object store once (:mod:`rlinfer_ray.shipping`) and staged on
  every live replica at once while they generate; each replica's engine keeps its own handle in
  its actor (``ReplicaActor.staging``).
- A part that any replica fails to stage cancels the staging on every replica (typed error; a
  replica that died is restarted); the pool's weights and version do not change.
- Commit loads the staged weights on every replica at once, as an update does: when no replica
  loads them the error is raised and the version stays; when some do and others fail, the failed
  ones leave routing, are restarted and re-synced to the committed weights (their parts are
  staged and committed again on the fresh engine) before they serve again.
- A replica restarted while a staging is open holds nothing staged: it is restarted again at
  commit, and re-synced to the committed weights.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core.errors import EngineDead
from rlinfer_core.weights import Buckets, NamedTensors, WeightUpdate
from rlinfer_ray.control import first_error
from rlinfer_ray.replica import is_replica_death
from rlinfer_ray.replicas import Replica, ReplicaSet
from rlinfer_ray.shipping import ShippedWeights

if TYPE_CHECKING:
    from rlinfer_core.types import EngineConfig
    from rlinfer_ray.control import ControlPlane


@attrs.frozen
class StagedParts:
    """The parts of the last staged commit, as the pool shipped them: how a restarted replica
    gets the committed weights back (staged and committed on it, in one version)."""

    parts: tuple[Any, ...]

    async def load(self, replicas: ReplicaSet, replica: Replica, version: int, timeout: float) -> None:
        """Stage every part on ``replica`` and commit them as ``version``."""
        staging_id = f"resync-{uuid.uuid4().hex}"
        try:
            for part in self.parts:
                ref = replica.actor.staging.remote("stage", staging_id, part, version)
                await replicas.call_raw(replica, ref, timeout, "stage_weights")
            ref = replica.actor.staging.remote("commit", staging_id, version)
            await replicas.call_raw(replica, ref, timeout, "commit_staged_weights")
        except BaseException:
            with contextlib.suppress(Exception):
                await replicas.call_raw(replica, replica.actor.staging.remote("cancel", staging_id), 60.0, "cancel")
            raise


@attrs.define(eq=False)
class PoolStaging:
    """The pool's open staging: its id, the replicas that staged it and its parts; loads, and the
    restarts of replicas that fail them, go through ``control`` (under its weight lock)."""

    replicas: ReplicaSet
    control: ControlPlane
    config: EngineConfig
    #: the open staging's id (the facade's), its members (replica index -> actor generation
    #: that staged) and its parts as shipped
    _staging_id: str | None = attrs.field(default=None, init=False)
    _staging_members: dict[int, int] = attrs.field(factory=dict, init=False)
    _staged_parts: list[Any] = attrs.field(factory=list, init=False)

    async def stage(self, staging_id: str, update: WeightUpdate) -> None:
        """Stage one part on every replica that staged the earlier ones; any failure cancels the staging."""
        import ray

        async with self.control.weight_lock:
            if staging_id != self._staging_id:  # its first part
                members = self.replicas.alive()
                if not members:
                    states = [r.state.value for r in self.replicas.replicas]
                    raise EngineDead(f"no replica of the pool can stage weights: {states}")
                self._staging_id = staging_id
                self._staging_members = {r.index: r.generation for r in members}
                self._staged_parts = []
            source = update.source
            shipped = ray.put(ShippedWeights(source)) if isinstance(source, NamedTensors | Buckets) else source
            members = self._members()
            timeout = self.config.request_timeout_s

            def stage(r: Replica) -> Any:
                ref = r.actor.staging.remote("stage", staging_id, shipped, update.version)
                return self.replicas.call_raw(r, ref, timeout, "stage_weights")

            results = await self.replicas.fan_out(members, stage)
            failed = {i: res for i, res in results.items() if isinstance(res, BaseException)}
            if failed or not members:
                await self._drop(staging_id)
                for i, exc in failed.items():
                    if is_replica_death(exc):
                        self.control.replica_failed(self.replicas.replicas[i], exc)
                raise first_error(failed, "no replica of the pool could stage the update")
            self._staged_parts.append(shipped)

    async def commit(self, staging_id: str, version: int) -> None:
        """Load the staged weights on every replica that staged them, as an update is loaded."""
        async with self.control.weight_lock:
            if staging_id != self._staging_id:
                raise EngineDead(f"staging {staging_id} is not open on the pool's replicas")
            members = self._members()
            timeout = self.config.request_timeout_s
            results = await self.replicas.fan_out(
                members,
                lambda r: self.replicas.call_raw(
                    r, r.actor.staging.remote("commit", staging_id, version), timeout, "commit_staged_weights"
                ),
            )
            parts = tuple(self._staged_parts)
            replay = parts[0] if len(parts) == 1 else StagedParts(parts)
            try:
                self.control.settle(results, version, "no replica committed the staged update", replay)
            except BaseException:
                await self._drop(staging_id)
                raise
            self._staging_id, self._staged_parts = None, []
            for r in [r for r in self.replicas.alive() if r.index not in results]:
                # restarted while the staging was open: it holds none of it
                self.control.replica_failed(r, EngineDead(f"replica {r.index} was restarted while weights were staged"))

    async def cancel(self, staging_id: str) -> None:
        """Every replica drops what it staged."""
        async with self.control.weight_lock:
            await self._drop(staging_id)

    def _members(self) -> list[Replica]:
        """The replicas that staged (still the same actors)."""
        return [r for r in self.replicas.alive() if self._staging_members.get(r.index) == r.generation]

    async def _drop(self, staging_id: str) -> None:
        """End the staging: every replica drops what it staged (best effort: a replica that
        cannot answer is dead or restarting, and a fresh engine holds nothing staged)."""
        if staging_id != self._staging_id:
            return
        members = self._members()
        self._staging_id, self._staged_parts = None, []
        await self.replicas.fan_out(
            members,
            lambda r: self.replicas.call_raw(
                r, r.actor.staging.remote("cancel", staging_id), 60.0, "cancel_staged_weights"
            ),
        )
