"""The facade's staged weight updates (capability ``weights.staged``): the owner of the
handles ``AsyncEngine.stage_weights`` returns.

The handle and the semantics are :mod:`rlinfer_core.staging`. Here: validation at stage time
(the checks of ``update_weights``, plus names staged twice and the bound on staged bytes), the
backend's stage / commit / cancel hooks, and a commit that finishes as ``update_weights`` does
(:meth:`Weights.load_verified <rlinfer_core.engine_weights.Weights.load_verified>`: verification,
version, prefix-cache reset).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core.backend import StagingBackend
from rlinfer_core.engine_weights import source_names
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
from rlinfer_core.types import Capability, EngineConfig, MemoryTag
from rlinfer_core.weights import BroadcastSource, WeightSource, WeightUpdate

if TYPE_CHECKING:
    from rlinfer_core.engine_calls import BackendCalls
    from rlinfer_core.engine_weights import Weights
    from rlinfer_core.observers import Observers


class Staging:
    """The staged update now open on one engine (at most one), and every step of its life: stage
    while generating, commit at a step boundary, or cancel. It takes the :class:`Weights`' lock
    and finishes a commit as their update does."""

    def __init__(
        self,
        calls: BackendCalls,
        config: Callable[[], EngineConfig],
        observers: Observers,
        weights: Weights,
    ) -> None:
        self._calls = calls
        self._config = config
        self._observers = observers
        self._weights = weights
        #: the staged update now open, if any
        self.open: AsyncWeightStaging | None = None
        #: every source staged into it, kept for the commit's verification
        self._sources: list[WeightSource] = []

    async def stage(
        self, update: WeightUpdate | WeightSource | Mapping[str, Any], version: int | None
    ) -> AsyncWeightStaging:
        """``AsyncEngine.stage_weights``."""
        self._calls.ensure_open()
        self._calls.capabilities.require(Capability.WEIGHTS_STAGED)
        update = as_weight_update(update, version)
        weights = self._weights
        async with weights.lock:
            if self.open is not None:
                raise WeightStagingError(
                    f"staging {self.open.staging_id} is open; commit or cancel it before staging again"
                )
            target = update_target(update, weights.version, self._calls.capabilities, weights.released)
            staging = AsyncWeightStaging(self, uuid.uuid4().hex, target)
            self._sources = []
            await self._stage_locked(staging, update)
            self.open = staging
        return staging

    @property
    def limit(self) -> int:
        """``AsyncEngine.staged_weight_limit``."""
        bound = self._config().max_staged_weight_bytes
        if bound is not None:
            return bound
        from rlinfer_core.transfer.buckets import to_dtype

        return sum(s.numel * to_dtype(s.dtype).itemsize for s in self._weights.specs.values())

    # --- the handle's owner (rlinfer_core.staging.StagingOwner) ---------------------------------

    async def _stage_more(self, staging: AsyncWeightStaging, update: WeightUpdate) -> None:
        self._calls.ensure_open()
        async with self._weights.lock:
            self._require_current(staging)
            await self._stage_locked(staging, update)

    async def _commit_staging(self, staging: AsyncWeightStaging) -> int:
        self._calls.ensure_open()
        commit = self._calls.optional(StagingBackend.rlinfer_commit_staged_weights)
        started = time.perf_counter()
        weights = self._weights
        async with weights.lock:
            self._require_current(staging)
            try:
                if MemoryTag.WEIGHTS in weights.released:
                    raise WeightUpdateError("weights are released; call resume_memory(['weights']) first")
                weights.check_refill(staging.names, None)
            except Exception as exc:
                self._emit_failed(exc)
                raise  # nothing was touched: the staging stays open
            try:
                load = commit(staging.staging_id, staging.version)
                await weights.load_verified(load, self._sources, staging.version, "commit_staged_weights")
            except Exception as exc:
                self._emit_failed(exc)
                with contextlib.suppress(Exception):  # the failed commit is what the caller must see
                    await self._drop(staging, StagingState.CANCELLED)
                raise
            await self._drop(staging, StagingState.COMMITTED, backend=False)  # the backend dropped them
        self._observers.emit(
            "rlinfer_on_weights_updated",
            backend=self._calls.name,
            version=staging.version,
            transport="staged",
            nbytes=staging.staged_bytes,
            seconds=time.perf_counter() - started,
        )
        return staging.version

    async def _cancel_staging(self, staging: AsyncWeightStaging) -> None:
        async with self._weights.lock:
            if self.open is staging and staging.state is StagingState.OPEN:
                await self._drop(staging, StagingState.CANCELLED)

    # --- helpers ----------------------------------------------------------------------------------

    def _require_current(self, staging: AsyncWeightStaging) -> None:
        staging._require_open("use")
        if self.open is not staging:
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
        self._calls.capabilities.require(transport_capability(update.source))
        source = self._weights.under_checkpoint_names(update.source)
        nbytes = self._weights.validate(source)
        names = frozenset(source_names(source))
        twice = sorted(names & staging.names)
        if twice:
            raise WeightStagingError(
                f"{len(twice)} tensors are staged already in this staging", tuple(f"{n}: staged twice" for n in twice)
            )
        limit = self.limit
        if staging.staged_bytes + nbytes > limit:
            raise StagingLimitExceeded(staging.staged_bytes, nbytes, limit)
        stage = self._calls.optional(StagingBackend.rlinfer_stage_weights)
        part = attrs.evolve(update, source=source, version=staging.version)
        try:
            await self._calls.with_timeout(
                stage(staging.staging_id, part), self._config().request_timeout_s, "stage_weights"
            )
        except Exception as exc:
            with contextlib.suppress(Exception):  # the failure to stage is what the caller must see
                await self._drop(staging, StagingState.CANCELLED)
            if isinstance(exc, WeightUpdateError | EngineDead | EngineTimeout):
                raise
            await self._calls.raise_if_dead(exc)
            raise WeightUpdateError(f"backend {self._calls.name!r} failed to stage the update: {exc}") from exc
        self._sources.append(source)
        staging._staged(names, nbytes)

    async def _drop(self, staging: AsyncWeightStaging, state: StagingState, *, backend: bool = True) -> None:
        """End ``staging`` (the backend drops its tensors unless it did already)."""
        staging._closed(state)
        if self.open is staging:
            self.open = None
        self._sources = []
        if backend and not self._calls.closed:
            try:
                cancel = self._calls.optional(StagingBackend.rlinfer_cancel_staged_weights)
                await self._calls.with_timeout(cancel(staging.staging_id), 60.0, "cancel_staged_weights")
            except Exception as exc:
                await self._calls.raise_if_dead(exc)
                raise

    def _emit_failed(self, exc: BaseException) -> None:
        self._observers.emit("rlinfer_on_weight_update_failed", backend=self._calls.name, transport="staged", error=exc)
