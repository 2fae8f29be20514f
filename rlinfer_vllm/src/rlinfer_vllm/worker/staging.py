"""Staged weights inside vLLM's worker processes (capability ``weights.staged``), a mixin of
:class:`rlinfer_vllm.worker.RLInferWorkerExtension`.

``rlinfer_stage_<transport>`` takes what ``rlinfer_load_<transport>`` takes, after a staging id,
and keeps the tensors in the worker: copied out of the sender's shared memory / CUDA-IPC
buffers into the worker's own memory (the device it serves on), or read from a checkpoint
directory. The live weights are not touched and the scheduler is not paused: vLLM runs these
calls between engine steps, so generation only waits for the copy.
``rlinfer_commit_staged`` loads everything staged as one update through the same path as an
update (:meth:`RLInferWorkerExtension._rlinfer_apply`: checks, in-place or reload, shadow), and
``rlinfer_cancel_staged`` drops it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Pair = tuple[str, "torch.Tensor"]


def received_buckets(manifests: bytes, payload: bytes, keep: bool) -> tuple[list[Pair], int]:
    """The tensors of core buckets sent as pickled manifests plus data shared through ipc (the
    facade verified their checksums on these very bytes), and how many buckets were mapped
    already; ``keep``: hold the CUDA ones mapped until the next update (ipc.keep_mapped)."""
    import pickle

    from rlinfer_core.transfer import ipc
    from rlinfer_core.transfer.buckets import unpack_all
    from rlinfer_core.weights import Bucket

    metas = pickle.loads(manifests)
    datas = [t for _, t in ipc.loads(payload)]
    reused = ipc.keep_mapped(datas if keep else ())
    buckets = [Bucket(m, d) for m, d in zip(metas, datas, strict=True)]
    return unpack_all(buckets, check=False), reused


class StagedWeightsWorker:
    """The staging half of the worker extension (see the module docstring)."""

    vllm_config: Any
    device: Any
    _rlinfer_staged: dict[str, dict[str, torch.Tensor]]

    def _rlinfer_check(self, tensors: Sequence[Pair]) -> None:
        raise NotImplementedError

    def _rlinfer_apply(self, tensors: Sequence[Pair], map_s: float) -> dict[str, float]:
        raise NotImplementedError

    def rlinfer_stage_ipc(self, staging_id: str, payload: bytes) -> dict[str, float]:
        """Stage (name, tensor) pairs shared by :func:`rlinfer_core.transfer.ipc.dumps`."""
        from rlinfer_core.transfer import ipc

        return self._rlinfer_stage(staging_id, ipc.loads(payload), copy=True)

    def rlinfer_stage_buckets(
        self, staging_id: str, manifests: bytes, payload: bytes, keep: bool = False
    ) -> dict[str, float]:
        """Stage core buckets (pickled manifests plus their data shared through ipc; ``keep``: as
        in ``rlinfer_load_buckets``)."""
        tensors, reused = received_buckets(manifests, payload, keep)
        return {**self._rlinfer_stage(staging_id, tensors, copy=True), "ipc_reused": reused}

    def rlinfer_stage_dir(self, staging_id: str, path: str) -> dict[str, float]:
        """Stage every tensor of a safetensors directory, all checked finite."""
        from rlinfer_core.transfer.disk import read_checked

        return self._rlinfer_stage(staging_id, read_checked(path, self._rlinfer_staging_device()), copy=False)

    def rlinfer_commit_staged(self, staging_id: str) -> dict[str, float]:
        """Load everything staged under ``staging_id`` as one update (all or nothing); drop it."""
        staged = self._rlinfer_staged_of().pop(staging_id, None)
        if staged is None:
            from rlinfer_core.errors import WeightUpdateError

            raise WeightUpdateError(f"nothing is staged under {staging_id!r} in the vLLM worker")
        return self._rlinfer_apply(list(staged.items()), map_s=0.0)

    def rlinfer_cancel_staged(self, staging_id: str) -> int:
        """Drop what is staged under ``staging_id``; the bytes freed."""
        staged = self._rlinfer_staged_of().pop(staging_id, None) or {}
        return sum(t.numel() * t.element_size() for t in staged.values())

    def rlinfer_release_mapped(self) -> None:
        """Drop the CUDA buckets kept mapped since the last update or staging (at shutdown, so that
        the sender can free them: :meth:`rlinfer_core.transfer.arena.PackArena.close`)."""
        from rlinfer_core.transfer import ipc

        ipc.keep_mapped(())

    def rlinfer_staged_bytes(self) -> int:
        """Bytes this worker holds staged (every staging id)."""
        return sum(t.numel() * t.element_size() for s in self._rlinfer_staged_of().values() for t in s.values())

    # --- helpers --------------------------------------------------------------------------------

    def _rlinfer_staged_of(self) -> dict[str, dict[str, torch.Tensor]]:
        staged = getattr(self, "_rlinfer_staged", None)
        if staged is None:
            staged = self._rlinfer_staged = {}
        return staged

    def _rlinfer_staging_device(self) -> Any:
        return "cpu" if self.vllm_config.device_config.device_type == "cpu" else self.device

    def _rlinfer_stage(self, staging_id: str, tensors: Sequence[Pair], copy: bool) -> dict[str, float]:
        """Check ``tensors`` as an update would be checked, then keep them (copies in the worker's
        own memory) under ``staging_id``; nothing is kept when any is refused."""
        from rlinfer_core.errors import WeightUpdateError

        started = time.perf_counter()
        self._rlinfer_check(tensors)
        held = self._rlinfer_staged_of().setdefault(staging_id, {})
        twice = [name for name, _ in tensors if name in held]
        if twice:
            raise WeightUpdateError("tensors staged twice", tuple(f"{n}: staged already" for n in twice))
        device = self._rlinfer_staging_device()
        # the sender frees (or reuses) its shared buffers once this call returns: copy out of them
        kept = {name: t.to(device=device, copy=True) if copy else t for name, t in tensors}
        if getattr(device, "type", device) == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()
        held.update(kept)
        nbytes = sum(t.numel() * t.element_size() for t in kept.values())
        return {"tensors": len(kept), "bytes": nbytes, "stage_s": time.perf_counter() - started}
