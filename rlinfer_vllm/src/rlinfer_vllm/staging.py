"""Staged weight updates (capability ``weights.staged``) for both vLLM backends: the hooks (mixins
of :class:`rlinfer_vllm.backend.VllmBackend` and the server-mode backend) over the worker's
staging (:mod:`rlinfer_vllm.worker_staging`).

Staging sends a part of the update over the transports of an update
(:func:`rlinfer_vllm.weights.send_source`: shared memory / CUDA IPC, buckets, a directory) into
``rlinfer_stage_<transport>`` instead of ``rlinfer_load_<transport>``, without pausing the
scheduler: vLLM runs the call between engine steps and requests keep generating on the live
weights. Commit is an update's load (scheduler paused "keep", version switched before it
resumes), from the staged tensors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rlinfer_core.errors import RLInferError, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.weights import WeightUpdate
from rlinfer_vllm.versions import TokenVersions
from rlinfer_vllm.weights import Rpc, prepare_source, send_source

logger = logging.getLogger("rlinfer_vllm.staging")

#: the worker's load methods and their staging twins (rlinfer_vllm.worker_staging)
STAGE_METHODS = {
    "rlinfer_load_ipc": "rlinfer_stage_ipc",
    "rlinfer_load_buckets": "rlinfer_stage_buckets",
    "rlinfer_load_dir": "rlinfer_stage_dir",
}


async def stage_source(staging_id: str, update: WeightUpdate, rpc: Rpc) -> Any:
    """Send ``update``'s source as :func:`send_source` would, into the worker's staging under
    ``staging_id``; the worker's timings."""

    async def staging_rpc(method: str, *args: Any) -> Any:
        staged = STAGE_METHODS.get(method)
        if staged is None:  # a broadcast: the facade refuses it before (nothing to stage ahead)
            raise WeightUpdateError(f"vLLM cannot stage an update sent by {method}")
        return await rpc(staged, staging_id, *args)

    prepared = await prepare_source(update.source)
    return await send_source(update.source, prepared, staging_rpc)


@contextlib.contextmanager
def _failures_typed(what: str) -> Iterator[None]:
    """An engine failure inside becomes WeightUpdateError naming ``what`` (rlinfer's errors pass)."""
    try:
        yield
    except RLInferError:
        raise
    except Exception as exc:
        raise WeightUpdateError(f"vLLM failed to {what}: {exc}") from exc


class StagingHooks:
    """Staging hooks of the in-process backend."""

    _versions: TokenVersions | None

    if TYPE_CHECKING:  # the backend's (rlinfer_vllm.backend, rlinfer_vllm.weights)

        async def _rpc(self, method: str, *args: Any) -> Any: ...

        def _paused_for_load(self) -> contextlib.AbstractAsyncContextManager[Any]: ...

    @hookimpl
    async def rlinfer_stage_weights(self, staging_id: str, update: WeightUpdate) -> None:
        """Copy the (validated) part into the worker's staging; generation goes on."""
        with _failures_typed("stage the update"):
            worker = await stage_source(staging_id, update, self._rpc)
        logger.debug("staged under %s: %s", staging_id, worker)

    @hookimpl
    async def rlinfer_commit_staged_weights(self, staging_id: str, version: int) -> None:
        """Load the staged tensors while the scheduler is paused; tokens after it are ``version``."""
        with _failures_typed("load the staged update"):
            async with self._paused_for_load():
                worker = await self._rpc("rlinfer_commit_staged", staging_id)
                assert self._versions is not None
                self._versions.version = version
        logger.debug("committed %s: %s", staging_id, worker)

    @hookimpl
    async def rlinfer_cancel_staged_weights(self, staging_id: str) -> None:
        """Drop the worker's staged tensors."""
        await self._rpc("rlinfer_cancel_staged", staging_id)

    async def staged_bytes_in_engine(self) -> int:
        """Bytes the worker holds staged (not a hook: tests and diagnostics read it)."""
        held: int = await self._rpc("rlinfer_staged_bytes")
        return held


class ServerStagingHooks:
    """Staging hooks of the server-mode backend: the worker calls through ``/collective_rpc``."""

    version: int

    if TYPE_CHECKING:  # the server-mode backend's (rlinfer_vllm.server_mode)

        def _alive(self) -> Any: ...

        def _paused_for_load(self) -> contextlib.AbstractAsyncContextManager[Any]: ...

        async def _label_version(self, http: Any, version: int) -> None: ...

    def _server_rpc(self, http: Any) -> Rpc:
        from rlinfer_vllm.server_mode.http import b64

        async def rpc(method: str, *args: Any) -> Any:
            return await http.rpc(method, *(b64(a) if isinstance(a, bytes) else a for a in args))

        return rpc

    @hookimpl
    async def rlinfer_stage_weights(self, staging_id: str, update: WeightUpdate) -> None:
        """Copy the (validated) part into the worker's staging through the server; generation goes on."""
        with _failures_typed("stage the update"):
            await stage_source(staging_id, update, self._server_rpc(self._alive()))

    @hookimpl
    async def rlinfer_commit_staged_weights(self, staging_id: str, version: int) -> None:
        """Load the staged tensors while the server's scheduler is paused, then label the version."""
        with _failures_typed("load the staged update"):
            async with self._paused_for_load() as http:
                await self._server_rpc(http)("rlinfer_commit_staged", staging_id)
                await self._label_version(http, version)
                self.version = version

    @hookimpl
    async def rlinfer_cancel_staged_weights(self, staging_id: str) -> None:
        """Drop the worker's staged tensors."""
        await self._server_rpc(self._alive())("rlinfer_cancel_staged", staging_id)

    async def staged_bytes_in_engine(self) -> int:
        """Bytes the worker holds staged (not a hook: tests and diagnostics read it)."""
        held: int = await self._server_rpc(self._alive())("rlinfer_staged_bytes")
        return held


__all__ = ["STAGE_METHODS", "ServerStagingHooks", "StagingHooks", "stage_source"]
