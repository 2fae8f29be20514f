"""Staged weight updates over the pool (capability ``weights.staged``; handle and semantics:
:mod:`rlinfer_core.staging`): stage on every replica, commit on all or none.

- Each part is validated once here (as an update is, plus names staged twice and the bound
  ``EngineConfig.max_staged_weight_bytes``), put into Ray's object store once
  (:mod:`rlinfer_ray.shipping`), and staged on every live replica at once while they generate;
  each replica's engine keeps its own handle in its actor (``ReplicaActor.staging``).
- A part that any replica fails to stage cancels the staging on every replica (typed error; a
  replica that died is restarted); the pool's weights and version do not change.
- Commit loads the staged weights on every replica at once, as ``update_weights`` does: when no
  replica loads them the error is raised and the version stays; when some do and others fail,
  the failed ones leave routing, are restarted and re-synced to the committed weights (their
  parts are staged and committed again on the fresh engine) before they serve again.
- A replica restarted while a staging is open holds nothing staged: it is restarted again at
  commit, and re-synced to the committed weights.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from rlinfer_core.errors import (
    EngineDead,
    InvalidRequest,
    RLInferError,
    StagingLimitExceeded,
    WeightStagingError,
    WeightUpdateError,
)
from rlinfer_core.preflight import as_weight_update, transport_capability, update_target
from rlinfer_core.staging import AsyncWeightStaging, StagingState
from rlinfer_core.types import Capability
from rlinfer_core.weights import BroadcastSource, Buckets, NamedTensors, WeightSource, WeightUpdate
from rlinfer_ray.control import ControlPlane
from rlinfer_ray.replica import is_replica_death
from rlinfer_ray.replicas import Replica, ReplicaSet, State
from rlinfer_ray.shipping import ShippedWeights


@attrs.frozen
class StagedParts:
    """The parts of the last staged commit, as the pool shipped them: how a restarted replica
    gets the committed weights back (staged and committed on it, in one version)."""

    parts: tuple[Any, ...]

    async def load(self, replicas: ReplicaSet, replica: Replica, version: int, timeout: float) -> None:
        """Stage every part on ``replica`` and commit them as ``version``."""
        staging_id = f"resync-{uuid.uuid4().hex}"
        try:
            await replicas.call_raw(
                replica,
                replica.actor.staging.remote("stage", staging_id, self.parts[0], version=version),
                timeout,
                "stage_weights",
            )
            for part in self.parts[1:]:
                await replicas.call_raw(
                    replica, replica.actor.staging.remote("add", staging_id, part), timeout, "stage"
                )
            await replicas.call_raw(replica, replica.actor.staging.remote("commit", staging_id), timeout, "commit")
        except BaseException:
            with contextlib.suppress(Exception):
                await replicas.call_raw(replica, replica.actor.staging.remote("cancel", staging_id), 60.0, "cancel")
            raise


class PoolStaging(ControlPlane):
    """``stage_weights`` of :class:`~rlinfer_ray.pool.EnginePool` (a base class of it)."""

    _open_staging: AsyncWeightStaging | None = None
    #: the open staging's members: replica index -> actor generation that staged
    _staging_members: dict[int, int]
    #: the open staging's parts as shipped, and the names staged
    _staged_parts: list[Any]

    async def stage_weights(
        self, update: WeightUpdate | WeightSource | Mapping[str, Any], *, version: int | None = None
    ) -> AsyncWeightStaging:
        """Stage ``update`` on every replica while they generate; the handle (see the module
        docstring and :meth:`rlinfer_core.engine.AsyncEngine.stage_weights`)."""
        self._ensure_open()
        self._caps().require(Capability.WEIGHTS_STAGED)
        update = as_weight_update(update, version)
        async with self._weight_lock:
            if self._open_staging is not None:
                raise WeightStagingError(
                    f"staging {self._open_staging.staging_id} is open; commit or cancel it before staging again"
                )
            target = update_target(update, self._version, self._caps(), self._released)
            members = self.replicas.alive()
            if not members:
                raise EngineDead(f"no replica of the pool can stage weights: {[r.state.value for r in members]}")
            staging = AsyncWeightStaging(self, uuid.uuid4().hex, target)
            self._staging_members = {r.index: r.generation for r in members}
            self._staged_parts = []
            await self._stage_locked(staging, update, first=True)
            self._open_staging = staging
        return staging

    @property
    def staged_weight_limit(self) -> int:
        """The most bytes a staging may hold on each replica (``EngineConfig.max_staged_weight_bytes``,
        by default one full copy of the weights)."""
        if self.config.max_staged_weight_bytes is not None:
            return self.config.max_staged_weight_bytes
        from rlinfer_core.transfer.buckets import to_dtype

        return sum(s.numel * to_dtype(s.dtype).itemsize for s in self._weight_specs.values())

    # --- the handle's owner (rlinfer_core.staging.StagingOwner) ---------------------------------

    async def _stage_more(self, staging: AsyncWeightStaging, update: WeightUpdate) -> None:
        self._ensure_open()
        async with self._weight_lock:
            self._require_current(staging)
            await self._stage_locked(staging, update, first=False)

    async def _commit_staging(self, staging: AsyncWeightStaging) -> int:
        self._ensure_open()
        started = time.perf_counter()
        async with self._weight_lock:
            self._require_current(staging)
            try:
                target = await self._commit_locked(staging)
            except Exception as exc:
                self._observers.emit(
                    "rlinfer_on_weight_update_failed", backend=self.backend_name, transport="staged", error=exc
                )
                raise
        self._observers.emit(
            "rlinfer_on_weights_updated",
            backend=self.backend_name,
            version=target,
            transport="staged",
            nbytes=staging.staged_bytes,
            seconds=time.perf_counter() - started,
        )
        return target

    async def _cancel_staging(self, staging: AsyncWeightStaging) -> None:
        async with self._weight_lock:
            if self._open_staging is staging and staging.state is StagingState.OPEN:
                await self._end(staging, StagingState.CANCELLED)

    # --- helpers ----------------------------------------------------------------------------------

    def _require_current(self, staging: AsyncWeightStaging) -> None:
        staging._require_open("use")
        if self._open_staging is not staging:
            raise WeightStagingError(f"staging {staging.staging_id} is not open on this pool")

    def _members(self) -> list[Replica]:
        """The replicas that staged (still the same actors)."""
        return [r for r in self.replicas.alive() if self._staging_members.get(r.index) == r.generation]

    async def _stage_locked(self, staging: AsyncWeightStaging, update: WeightUpdate, first: bool) -> None:
        import ray

        from rlinfer_core.engine_weights import source_names
        from rlinfer_core.trainer_names import name_map, under_checkpoint_names
        from rlinfer_core.transfer.validate import validate_source

        if isinstance(update.source, BroadcastSource):
            raise InvalidRequest(
                "source", "stage_weights takes named tensors, buckets or a checkpoint directory, not a broadcast"
            )
        if update.version is not None and update.version != staging.version:
            raise InvalidRequest("version", f"this staging makes version {staging.version}, got {update.version}")
        self._caps().require(transport_capability(update.source))
        source = under_checkpoint_names(update.source, name_map(self._weight_specs))
        nbytes = validate_source(source, self._weight_specs)
        names = frozenset(source_names(source))
        twice = sorted(names & staging.names)
        if twice:
            raise WeightStagingError(
                f"{len(twice)} tensors are staged already in this staging", tuple(f"{n}: staged twice" for n in twice)
            )
        limit = self.staged_weight_limit
        if staging.staged_bytes + nbytes > limit:
            raise StagingLimitExceeded(staging.staged_bytes, nbytes, limit)
        shipped = ray.put(ShippedWeights(source)) if isinstance(source, NamedTensors | Buckets) else source
        members = self._members()
        timeout = self.config.request_timeout_s

        def stage(r: Replica) -> Any:
            if first:
                ref = r.actor.staging.remote("stage", staging.staging_id, shipped, version=staging.version)
            else:
                ref = r.actor.staging.remote("add", staging.staging_id, shipped)
            return self.replicas.call_raw(r, ref, timeout, "stage_weights")

        results = await self.replicas.fan_out(members, stage)
        failed = {i: res for i, res in results.items() if isinstance(res, BaseException)}
        if failed or not members:
            await self._end(staging, StagingState.CANCELLED)
            for i, exc in failed.items():
                if is_replica_death(exc):
                    self._replica_failed(self.replicas.replicas[i], exc)
            raise _first_error(failed, "no replica of the pool could stage the update", "stage")
        self._staged_parts.append(shipped)
        staging._staged(names, nbytes)

    async def _commit_locked(self, staging: AsyncWeightStaging) -> int:
        from rlinfer_core.types import MemoryTag

        if MemoryTag.WEIGHTS in self._released:
            raise WeightUpdateError("weights are released; call resume_memory(['weights']) first")
        members = self._members()
        timeout = self.config.request_timeout_s
        results = await self.replicas.fan_out(
            members,
            lambda r: self.replicas.call_raw(
                r, r.actor.staging.remote("commit", staging.staging_id), timeout, "commit_staged_weights"
            ),
        )
        loaded = [self.replicas.replicas[i] for i, res in results.items() if not isinstance(res, BaseException)]
        failed = {i: res for i, res in results.items() if isinstance(res, BaseException)}
        if not loaded:
            await self._end(staging, StagingState.CANCELLED)
            for i, exc in failed.items():
                if is_replica_death(exc):
                    self._replica_failed(self.replicas.replicas[i], exc)
            raise _first_error(failed, "no replica committed the staged update", "commit")
        staging._closed(StagingState.COMMITTED)
        self._open_staging = None
        self._version = staging.version
        parts = tuple(self._staged_parts)
        self._replay = parts[0] if len(parts) == 1 else StagedParts(parts)
        for r in loaded:
            r.version = staging.version
            if r.state is State.STALE:
                r.state = State.SERVING
        for i, exc in failed.items():
            # out of routing now; the restart re-syncs it to the new version once this lock is released
            self._replica_failed(self.replicas.replicas[i], exc)
        joined_since = [r for r in self.replicas.alive() if r.index not in results]
        for r in joined_since:  # restarted while the staging was open: it holds none of it
            self._replica_failed(r, EngineDead(f"replica {r.index} was restarted while weights were staged"))
        return staging.version

    async def _end(self, staging: AsyncWeightStaging, state: StagingState) -> None:
        """End ``staging``: every replica drops what it staged (best effort: a replica that
        cannot answer is dead or restarting, and a fresh engine holds nothing staged)."""
        staging._closed(state)
        if self._open_staging is staging:
            self._open_staging = None
        self._staged_parts = []
        members = self._members()
        await self.replicas.fan_out(
            members,
            lambda r: self.replicas.call_raw(
                r, r.actor.staging.remote("cancel", staging.staging_id), 60.0, "cancel_staged_weights"
            ),
        )


def _first_error(failed: Mapping[int, BaseException], message: str, what: str) -> BaseException:
    """The error a caller gets when replicas failed to ``what``: the first typed one (lowest
    replica index) that is not a replica's death, else a WeightUpdateError naming every failure."""
    for index in sorted(failed):
        exc = failed[index]
        if isinstance(exc, RLInferError) and not is_replica_death(exc):
            return exc
    return WeightUpdateError(message, tuple(f"replica {i}: {exc}" for i, exc in sorted(failed.items())))


__all__ = ["PoolStaging", "StagedParts"]
