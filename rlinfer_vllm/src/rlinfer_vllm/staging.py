"""Staged weight updates (capability ``weights.staged``, both flavours): :class:`Staging`, over
the worker's staging (:mod:`rlinfer_vllm.worker.staging`).

Staging sends a part of the update over the transports of an update
(:meth:`rlinfer_vllm.weights.WeightSync.send`: shared memory / CUDA IPC, buckets, a directory)
into ``rlinfer_stage_<transport>`` instead of ``rlinfer_load_<transport>``, without pausing the
scheduler: vLLM runs the call between engine steps and requests keep generating on the live
weights. Commit is an update's load (:meth:`rlinfer_vllm.load_gate.LoadSequencing.loading`:
between two engine steps, the version switched at that boundary), from the staged tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.weights import WeightUpdate
from rlinfer_vllm.weights import failures_typed

if TYPE_CHECKING:
    from rlinfer_vllm.load_gate import LoadSequencing
    from rlinfer_vllm.transport import Transport
    from rlinfer_vllm.weights import WeightSync

logger = logging.getLogger("rlinfer_vllm.staging")

#: the worker's load methods and their staging twins (rlinfer_vllm.worker.staging)
STAGE_METHODS = {
    "rlinfer_load_ipc": "rlinfer_stage_ipc",
    "rlinfer_load_buckets": "rlinfer_stage_buckets",
    "rlinfer_load_dir": "rlinfer_stage_dir",
}


class Staging:
    """Parts of an update copied into the worker while generation goes on, loaded at commit."""

    def __init__(self, alive: Callable[[], Transport], weights: WeightSync, sequencing: LoadSequencing) -> None:
        self._alive = alive  #: the live transport (EngineDead once shut down)
        self._weights = weights  #: packs and sends sources as an update's load does
        self._sequencing = sequencing

    async def stage(self, staging_id: str, update: WeightUpdate) -> None:
        """Copy the (validated) part into the worker's staging under ``staging_id``."""
        rpc = self._alive().rpc

        async def staging_rpc(method: str, *args: Any) -> Any:
            staged = STAGE_METHODS.get(method)
            if staged is None:  # a broadcast: the facade refuses it before (nothing to stage ahead)
                raise WeightUpdateError(f"vLLM cannot stage an update sent by {method}")
            return await rpc(staged, staging_id, *args)

        with failures_typed("stage the update"):
            prepared = await self._weights.prepare(update.source)
            worker = await self._weights.send(update.source, prepared, staging_rpc)
        logger.debug("staged under %s: %s", staging_id, worker)

    async def commit(self, staging_id: str, version: int) -> None:
        """Load the staged tensors with no engine step overlapping; tokens after it are ``version``."""
        with failures_typed("load the staged update"):
            async with self._sequencing.loading(version) as rpc:
                worker = await rpc("rlinfer_commit_staged", staging_id)
        logger.debug("committed %s: %s", staging_id, worker)

    async def cancel(self, staging_id: str) -> None:
        """Drop the worker's staged tensors."""
        await self._alive().rpc("rlinfer_cancel_staged", staging_id)
