"""The facade's staged weight updates (part of ``AsyncEngine``; capability ``weights.staged``).

The handle and the semantics are :mod:`rlinfer_core.staging`. Here: validation at stage time
(the checks of ``update_weights``, plus names staged twice and the bound on staged bytes), the
backend's stage / commit / cancel hooks, and a commit that finishes as ``update_weights`` does
(:meth:`EngineWeights._load_verified`: verification, version, prefix-cache reset).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from rlinfer_core.backend import StagingBackend
from rlinfer_core.engine_weights import EngineWeights, source_names
from rlinfer_core.errors import (
    EngineDead,
    EngineTimeout,
    InvalidRequest,
    StagingLimitExceeded,
    WeightStagingError,
    WeightUpdateError,
)
from rlinfer_core.preflight import as_weight_update, transport_capability, update_target
from rlinfer_core.staging import AsyncWeightStaging, StagingState
from rlinfer_core.types import Capability, MemoryTag
from rlinfer_core.weights import BroadcastSource, WeightSource, WeightUpdate


class EngineStaging(EngineWeights):
    """Staged weight updates: stage while generating, commit at a step boundary, or cancel."""

    #: every source staged into the open staging, kept for the commit's verification
    _staged_sources: list[WeightSource]

    async def stage_weights(
        self, update: WeightUpdate | WeightSource | Mapping[str, Any], *, version: int | None = None
    ) -> AsyncWeightStaging:
        """Validate ``update`` and move it into the engine while generation goes on; return the
        handle to :meth:`~rlinfer_core.staging.AsyncWeightStaging.add` more buckets to,
        ``commit()`` or ``cancel()`` (see :mod:`rlinfer_core.staging` for the semantics).

        Takes what ``update_weights`` takes except a WeightDelta and a broadcast source. The
        version (``version``, else the live one + 1) is fixed now. WeightStagingError while
        another staging is open; StagingLimitExceeded over ``EngineConfig.max_staged_weight_bytes``.
        """
        self._ensure_open()
        self.capabilities.require(Capability.WEIGHTS_STAGED)
        update = as_weight_update(update, version)
        async with self._weight_lock:
            if self._open_staging is not None:
                raise WeightStagingError(
                    f"staging {self._open_staging.staging_id} is open; commit or cancel it before staging again"
                )
            target = update_target(update, self._version, self.capabilities, self._released)
            staging = AsyncWeightStaging(self, uuid.uuid4().hex, target)
            self._staged_sources = []
            await self._stage_locked(staging, update)
            self._open_staging = staging
        return staging

    @property
    def staged_weight_limit(self) -> int:
        """The most bytes a staging may hold: ``EngineConfig.max_staged_weight_bytes``, by
        default one full copy of the weights (:attr:`weight_specs`)."""
        if self.config.max_staged_weight_bytes is not None:
            return self.config.max_staged_weight_bytes
        from rlinfer_core.transfer.buckets import to_dtype

        return sum(s.numel * to_dtype(s.dtype).itemsize for s in self.weight_specs.values())

    # --- the handle's owner (rlinfer_core.staging.StagingOwner) ---------------------------------

    async def _stage_more(self, staging: AsyncWeightStaging, update: WeightUpdate) -> None:
        self._ensure_open()
        async with self._weight_lock:
            self._require_current(staging)
            await self._stage_locked(staging, update)

    async def _commit_staging(self, staging: AsyncWeightStaging) -> int:
        self._ensure_open()
        commit = self._optional(StagingBackend.rlinfer_commit_staged_weights)
        started = time.perf_counter()
        async with self._weight_lock:
            self._require_current(staging)
            try:
                if MemoryTag.WEIGHTS in self._released:
                    raise WeightUpdateError("weights are released; call resume_memory(['weights']) first")
                self._check_refill(staging.names, None)
            except Exception as exc:
                self._emit_failed(exc)
                raise  # nothing was touched: the staging stays open
            try:
                load = commit(staging.staging_id, staging.version)
                await self._load_verified(load, self._staged_sources, staging.version, "commit_staged_weights")
            except Exception as exc:
                self._emit_failed(exc)
                with contextlib.suppress(Exception):  # the failed commit is what the caller must see
                    await self._drop(staging, StagingState.CANCELLED)
                raise
            await self._drop(staging, StagingState.COMMITTED, backend=False)  # the backend dropped them
        self._observers.emit(
            "rlinfer_on_weights_updated",
            backend=self.backend_name,
            version=staging.version,
            transport="staged",
            nbytes=staging.staged_bytes,
            seconds=time.perf_counter() - started,
        )
        return staging.version

    async def _cancel_staging(self, staging: AsyncWeightStaging) -> None:
        async with self._weight_lock:
            if self._open_staging is staging and staging.state is StagingState.OPEN:
                await self._drop(staging, StagingState.CANCELLED)

    # --- helpers ----------------------------------------------------------------------------------

    def _require_current(self, staging: AsyncWeightStaging) -> None:
        staging._require_open("use")
        if self._open_staging is not staging:
            raise WeightStagingError(f"staging {staging.staging_id} is not open on this engine")

    async def _stage_locked(self, staging: AsyncWeightStaging, update: WeightUpdate) -> None:
        """Validate ``update`` as a part of ``staging`` and have the backend stage it. A refusal
        here leaves the staging as it was; a failure inside the engine cancels the staging."""
        if isinstance(update.source, BroadcastSource):
            raise InvalidRequest(
                "source", "stage_weights takes named tensors, buckets or a checkpoint directory, not a broadcast"
            )
        if update.version is not None and update.version != staging.version:
            raise InvalidRequest("version", f"this staging makes version {staging.version}, got {update.version}")
        self.capabilities.require(transport_capability(update.source))
        source = self._under_checkpoint_names(update.source)
        nbytes = self._validate(source)
        names = frozenset(source_names(source))
        twice = sorted(names & staging.names)
        if twice:
            raise WeightStagingError(
                f"{len(twice)} tensors are staged already in this staging", tuple(f"{n}: staged twice" for n in twice)
            )
        limit = self.staged_weight_limit
        if staging.staged_bytes + nbytes > limit:
            raise StagingLimitExceeded(staging.staged_bytes, nbytes, limit)
        stage = self._optional(StagingBackend.rlinfer_stage_weights)
        part = attrs.evolve(update, source=source, version=staging.version)
        try:
            await self._with_timeout(stage(staging.staging_id, part), self.config.request_timeout_s, "stage_weights")
        except Exception as exc:
            with contextlib.suppress(Exception):  # the failure to stage is what the caller must see
                await self._drop(staging, StagingState.CANCELLED)
            if isinstance(exc, WeightUpdateError | EngineDead | EngineTimeout):
                raise
            await self._raise_if_dead(exc)
            raise WeightUpdateError(f"backend {self.backend_name!r} failed to stage the update: {exc}") from exc
        self._staged_sources.append(source)
        staging._staged(names, nbytes)

    async def _drop(self, staging: AsyncWeightStaging, state: StagingState, *, backend: bool = True) -> None:
        """End ``staging`` (the backend drops its tensors unless it did already)."""
        staging._closed(state)
        if self._open_staging is staging:
            self._open_staging = None
        self._staged_sources = []
        if backend and not self._closed:
            try:
                cancel = self._optional(StagingBackend.rlinfer_cancel_staged_weights)
                await self._with_timeout(cancel(staging.staging_id), 60.0, "cancel_staged_weights")
            except Exception as exc:
                await self._raise_if_dead(exc)
                raise

    def _emit_failed(self, exc: BaseException) -> None:
        self._observers.emit(
            "rlinfer_on_weight_update_failed", backend=self.backend_name, transport="staged", error=exc
        )
