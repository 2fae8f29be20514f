"""Staged weight updates (capability ``weights.staged``): the handle a caller holds.

Async RL keeps generating while the trainer steps; what it feels of a weight sync is how long
generation stalls when the new weights arrive. ``stage_weights`` moves and validates the next
weights into the engine's own processes while generation goes on; ``commit`` makes them live at
a step boundary (the stall is the load alone); ``cancel`` drops them::

    staging = await engine.stage_weights(first_bucket)    # validated, sent into the engine
    await staging.add(second_bucket)                      # more buckets, same staging
    version = await staging.commit()                      # live now, as update_weights would be

Semantics (the engine, or a pool, is the *owner* that does the work; see
``rlinfer_core.engine_staging`` and ``rlinfer_ray``):

- at most one staging is open per engine; a second ``stage_weights``, or ``update_weights``,
  while one is open raises :class:`~rlinfer_core.errors.WeightStagingError`;
- everything is validated when it is staged (names, shapes, dtypes, finiteness, a name staged
  twice), so commit cannot fail on bad input; a refused ``add`` leaves what was staged before;
- the staged bytes are reported (:attr:`AsyncWeightStaging.staged_bytes`) and bounded by
  ``EngineConfig.max_staged_weight_bytes`` (default: one full copy of the weights):
  :class:`~rlinfer_core.errors.StagingLimitExceeded`, nothing of that update staged;
- ``commit`` loads everything staged as one update, all or nothing, with the version bookkeeping
  of ``update_weights`` (the version is fixed at stage time: :attr:`AsyncWeightStaging.version`);
- ``cancel`` (or leaving ``async with`` without a commit) drops the staged tensors; the old
  weights and version keep serving. A failure inside the engine while staging or committing ends
  the staging the same way.
"""

from __future__ import annotations

import enum
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rlinfer_core.errors import WeightStagingError
from rlinfer_core.sync_twin import SyncTwin, blocking, delegated_property

if TYPE_CHECKING:
    from rlinfer_core.weights import WeightSource, WeightUpdate

T = TypeVar("T")


class StagingState(enum.StrEnum):
    """Where a staging is: open (adding), committed (live) or cancelled (dropped)."""

    OPEN = "open"
    COMMITTED = "committed"
    CANCELLED = "cancelled"


class StagingOwner(Protocol):
    """What does the work behind a handle: an engine facade or a pool."""

    async def _stage_more(self, staging: AsyncWeightStaging, update: WeightUpdate) -> None: ...

    async def _commit_staging(self, staging: AsyncWeightStaging) -> int: ...

    async def _cancel_staging(self, staging: AsyncWeightStaging) -> None: ...


class AsyncWeightStaging:
    """An open staged update (from ``stage_weights``); see the module docstring."""

    def __init__(self, owner: StagingOwner, staging_id: str, version: int) -> None:
        self._owner = owner
        self._staging_id = staging_id
        self._version = version
        self._state = StagingState.OPEN
        self._staged_bytes = 0
        self._names: set[str] = set()

    @property
    def staging_id(self) -> str:
        """The id the engine keeps the staged tensors under."""
        return self._staging_id

    @property
    def version(self) -> int:
        """The weight version a commit makes live."""
        return self._version

    @property
    def state(self) -> StagingState:
        """Open, committed or cancelled."""
        return self._state

    @property
    def staged_bytes(self) -> int:
        """Bytes held in the engine for this staging (as sent)."""
        return self._staged_bytes

    @property
    def names(self) -> frozenset[str]:
        """The checkpoint names staged so far."""
        return frozenset(self._names)

    async def add(self, update: WeightUpdate | WeightSource | Mapping[str, Any]) -> int:
        """Stage one more part (a bucket) of the update; returns :attr:`staged_bytes`. A name
        already staged, a bad tensor or the bound exceeded raise, and leave what was staged."""
        from rlinfer_core.preflight import as_weight_update

        self._require_open("add to")
        await self._owner._stage_more(self, as_weight_update(update, None))
        return self._staged_bytes

    async def commit(self) -> int:
        """Make everything staged live (all or nothing, at a step boundary); the new version."""
        self._require_open("commit")
        return await self._owner._commit_staging(self)

    async def cancel(self) -> None:
        """Drop the staged tensors; the old weights keep serving. Nothing to do once the staging
        is committed or cancelled."""
        if self._state is StagingState.OPEN:
            await self._owner._cancel_staging(self)

    async def __aenter__(self) -> AsyncWeightStaging:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cancel()

    # --- kept by the owner ------------------------------------------------------------------------

    def _require_open(self, what: str) -> None:
        if self._state is not StagingState.OPEN:
            raise WeightStagingError(f"cannot {what} staging {self._staging_id}: it is {self._state.value}")

    def _staged(self, names: frozenset[str], nbytes: int) -> None:
        """Record a part the owner staged."""
        self._names |= names
        self._staged_bytes += nbytes

    def _closed(self, state: StagingState) -> None:
        self._state = state

    def __repr__(self) -> str:
        return (
            f"AsyncWeightStaging({self._staging_id}, version={self._version}, {self._state.value}, "
            f"{len(self._names)} tensors, {self._staged_bytes} bytes)"
        )


class WeightStaging(SyncTwin):
    """The blocking twin of :class:`AsyncWeightStaging` (from the sync ``Engine.stage_weights``)."""

    def __init__(self, engine: Any, inner: AsyncWeightStaging) -> None:
        self._engine = engine
        self.inner = inner

    def _target(self) -> AsyncWeightStaging:
        return self.inner

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        result: T = self._engine._run(coro)
        return result

    def __enter__(self) -> WeightStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __repr__(self) -> str:
        return repr(self.inner)

    staging_id = delegated_property(AsyncWeightStaging.staging_id)
    version = delegated_property(AsyncWeightStaging.version)
    state = delegated_property(AsyncWeightStaging.state)
    staged_bytes = delegated_property(AsyncWeightStaging.staged_bytes)
    names = delegated_property(AsyncWeightStaging.names)
    add = blocking(AsyncWeightStaging.add)
    commit = blocking(AsyncWeightStaging.commit)
    cancel = blocking(AsyncWeightStaging.cancel)


__all__ = ["AsyncWeightStaging", "StagingOwner", "StagingState", "WeightStaging"]
