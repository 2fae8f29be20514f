"""Staged weight updates (capability ``weights.staged``): the hooks (a mixin of
:class:`rlinfer_vllm.backend.VllmBackend`, both flavours) over the worker's staging
(:mod:`rlinfer_vllm.worker.staging`).

Staging sends a part of the update over the transports of an update
(:func:`rlinfer_vllm.weights.send_source`: shared memory / CUDA IPC, buckets, a directory) into
``rlinfer_stage_<transport>`` instead of ``rlinfer_load_<transport>``, without pausing the
scheduler: vLLM runs the call between engine steps and requests keep generating on the live
weights. Commit is an update's load (:meth:`rlinfer_vllm.weights.WeightHooks._loading`: between two engine
steps, the version switched at that boundary), from the staged tensors.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.weights import WeightUpdate
from rlinfer_vllm.weights import Rpc, engine_gpus, failures_typed, prepare_source, send_source

if TYPE_CHECKING:
    from rlinfer_core.transfer.arena import PackArena
    from rlinfer_core.types import EngineConfig
    from rlinfer_vllm.transport import Transport

logger = logging.getLogger("rlinfer_vllm.staging")

#: the worker's load methods and their staging twins (rlinfer_vllm.worker.staging)
STAGE_METHODS = {
    "rlinfer_load_ipc": "rlinfer_stage_ipc",
    "rlinfer_load_buckets": "rlinfer_stage_buckets",
    "rlinfer_load_dir": "rlinfer_stage_dir",
}


async def stage_source(staging_id: str, update: WeightUpdate, rpc: Rpc, engine_gpus: int, arena: PackArena) -> Any:
    """Send ``update``'s source as :func:`send_source` would (CUDA tensors packed into
    ``arena``), into the worker's staging under ``staging_id``; the worker's timings."""

    async def staging_rpc(method: str, *args: Any) -> Any:
        staged = STAGE_METHODS.get(method)
        if staged is None:  # a broadcast: the facade refuses it before (nothing to stage ahead)
            raise WeightUpdateError(f"vLLM cannot stage an update sent by {method}")
        return await rpc(staged, staging_id, *args)

    prepared = await prepare_source(update.source, engine_gpus, arena)
    with arena.sending():
        return await send_source(update.source, prepared, staging_rpc)


class StagingHooks:
    """Staging hooks of :class:`rlinfer_vllm.backend.VllmBackend` (both flavours)."""

    if TYPE_CHECKING:  # the backend's (rlinfer_vllm.backend, rlinfer_vllm.weights)
        config: EngineConfig
        _ipc_arena: PackArena

        def _alive(self) -> Transport: ...

        def _loading(self, version: int | None) -> contextlib.AbstractAsyncContextManager[Rpc]: ...

    @hookimpl
    async def rlinfer_stage_weights(self, staging_id: str, update: WeightUpdate) -> None:
        """Copy the (validated) part into the worker's staging; generation goes on."""
        with failures_typed("stage the update"):
            worker = await stage_source(
                staging_id, update, self._alive().rpc, engine_gpus(self.config), self._ipc_arena
            )
        logger.debug("staged under %s: %s", staging_id, worker)

    @hookimpl
    async def rlinfer_commit_staged_weights(self, staging_id: str, version: int) -> None:
        """Load the staged tensors with no engine step overlapping; tokens after it are ``version``."""
        with failures_typed("load the staged update"):
            async with self._loading(version) as rpc:
                worker = await rpc("rlinfer_commit_staged", staging_id)
        logger.debug("committed %s: %s", staging_id, worker)

    @hookimpl
    async def rlinfer_cancel_staged_weights(self, staging_id: str) -> None:
        """Drop the worker's staged tensors."""
        await self._alive().rpc("rlinfer_cancel_staged", staging_id)

    async def staged_bytes_in_engine(self) -> int:
        """Bytes the worker holds staged (not a hook: tests and diagnostics read it)."""
        held: int = await self._alive().rpc("rlinfer_staged_bytes")
        return held


__all__ = ["STAGE_METHODS", "StagingHooks", "stage_source"]
