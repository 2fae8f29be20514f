"""Share tensors with another process on the same host without copying them.

CPU tensors move into shared memory, CUDA tensors travel as CUDA IPC handles; both through
torch.multiprocessing's pickling reductions. :func:`dumps` gives bytes any RPC can carry;
:func:`loads` in the receiving process maps the same memory back. The sender must keep its
tensors alive until the receiver is done with them.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

    from rlinfer_core.transfer.arena import PackArena
    from rlinfer_core.weights import Bucket

#: CUDA tensors travel in buckets of at most this many bytes (see :func:`pack_cuda`)
CUDA_BUCKET_BYTES = 1 << 30


def dumps(tensors: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Serialize (name, tensor) pairs as shared-memory / CUDA-IPC handles."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    # file_system: handles are plain names, so the bytes can cross any channel (no fd passing).
    tmp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    shared = []
    for name, tensor in tensors:
        t = tensor.detach()
        if t.device.type == "cpu":
            t = _answered_by_the_manager(t.contiguous().share_memory_, "sharing")
        shared.append((name, t))
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(shared)
    return buf.getvalue()


#: what torch raises when its shared-memory manager (``torch_shm_manager``) does not answer within
#: its fixed poll timeout, on either side: the receiver's attach, or the sender's ``share_memory_``
#: (both seen on a loaded 2-core host with engines, Ray replicas and the trainer at once). Nothing
#: is shared or attached by the call that timed out, so making it again is safe
MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
#: seconds waited before each further try: the manager must answer within a fixed 1 s poll, which
#: a loaded host missed three times in a row once (a staged update to a Ray replica, clean clone
#: of 2026-11-27)
MANAGER_BACKOFF_S = (0.25, 0.5, 1.0, 2.0, 4.0)
#: tries before the manager's timeout is the caller's error
MANAGER_TRIES = len(MANAGER_BACKOFF_S) + 1

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _answered_by_the_manager(call: Callable[[], T], what: str) -> T:
    """``call()``, made again while torch's shared-memory manager times out (:data:`MANAGER_TIMEOUT`)."""
    for attempt in range(1, MANAGER_TRIES + 1):
        try:
            return call()
        except RuntimeError as exc:
            if MANAGER_TIMEOUT not in str(exc) or attempt == MANAGER_TRIES:
                raise
            logger.warning("%s tensors: torch's shared-memory manager timed out (try %d)", what, attempt)
            time.sleep(MANAGER_BACKOFF_S[attempt - 1])
    raise AssertionError("unreachable")


def loads(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    """Map tensors serialized by :func:`dumps` (in another process) into this one; an attach the
    shared-memory manager did not answer in time is tried again (:data:`MANAGER_TIMEOUT`)."""
    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    result: list[tuple[str, torch.Tensor]] = _answered_by_the_manager(lambda: pickle.loads(payload), "attaching")
    return result


def all_cuda(tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether there are tensors and every one is on a CUDA device (what :func:`pack_cuda` packs)."""
    return bool(tensors) and all(t.device.type == "cuda" for _, t in tensors)


def pack_cuda(
    tensors: Sequence[tuple[str, torch.Tensor]],
    visible_gpus: int | None = None,
    arena: PackArena | None = None,
    check_values: bool = False,
) -> list[Bucket] | None:
    """Pack CUDA tensors into per-dtype buckets (no checksum); None if any tensor is not on CUDA.

    The receiver maps one CUDA-IPC handle per *allocation*, and opening one is a driver call
    that costs far more than copying a tensor on the GPU; a trainer's state dict is hundreds of
    separate allocations. Packing costs one device-to-device copy of the update and a transient
    buffer of its size on the sender's GPU.

    ``visible_gpus``: the receiver sees only this process's GPUs ``0 .. visible_gpus - 1`` (vLLM
    gives its engine process only the engine's GPUs), and a handle to memory on another GPU
    cannot be opened there: tensors on another GPU are packed onto GPU 0 (a peer-to-peer copy
    instead of the local one).

    ``arena``: pack into its buffers (reused while the layout stays the same, so the receiver
    maps nothing new: :mod:`rlinfer_core.transfer.arena`) instead of fresh ones.

    ``check_values``: raise WeightUpdateError naming every tensor that holds NaN or inf, decided
    on the packed buckets (:func:`rlinfer_core.transfer.validate.packed_nonfinite_problems`): a
    backend that packs with it lets the facade skip its own pass over the values
    (``checks_cuda_tensor_values``, see :func:`rlinfer_core.hookspecs.rlinfer_update_weights`).
    """
    if not all_cuda(tensors):
        return None
    import torch

    from rlinfer_core.transfer.buckets import pack

    elsewhere = visible_gpus is not None and any((t.device.index or 0) >= visible_gpus for _, t in tensors)
    target = torch.device("cuda", 0) if elsewhere else None
    packer = pack if arena is None else arena.pack
    buckets = packer(tensors, CUDA_BUCKET_BYTES, with_checksum=False, device=target)
    # The receiver waits for the sender's stream only when it opens a handle for the first time;
    # a bucket reusing a block it mapped before (an arena's buffer, or the allocator handing the
    # same block out again) would be read while the packing copies may still run: finish them
    # before sharing.
    for device in {t.device for _, t in tensors} | ({target} if target is not None else set()):
        torch.cuda.synchronize(device)
    if check_values:
        from rlinfer_core.errors import WeightUpdateError
        from rlinfer_core.transfer.validate import packed_nonfinite_problems

        problems = packed_nonfinite_problems(buckets, tensors)
        if problems:
            raise WeightUpdateError("weight update rejected", tuple(problems))
    return buckets


def onto_visible_gpus(buckets: Sequence[Bucket], visible_gpus: int) -> list[Bucket]:
    """``buckets``, each one on a GPU the receiver cannot see (index ``>= visible_gpus``, see
    :func:`pack_cuda`) copied onto GPU 0; the others as they are."""
    import torch

    from rlinfer_core.weights import Bucket

    def hidden(bucket: Bucket) -> bool:
        return bucket.data.device.type == "cuda" and (bucket.data.device.index or 0) >= visible_gpus

    if not any(hidden(b) for b in buckets):
        return list(buckets)
    gpu0 = torch.device("cuda", 0)
    moved = [Bucket(b.manifest, b.data.to(gpu0)) if hidden(b) else b for b in buckets]
    torch.cuda.synchronize(gpu0)  # as in pack_cuda: the copies end before the handles are shared
    return moved


#: the CUDA tensors this process mapped for the last update (see :func:`keep_mapped`)
_MAPPED: list[torch.Tensor] = []


def keep_mapped(tensors: Sequence[torch.Tensor]) -> int:
    """In a receiving process: keep the CUDA tensors of ``tensors`` that were mapped from another
    process (by :func:`loads`, or an engine's own deserializer) alive until the next call, which
    replaces them; return how many of them were kept from the previous call (mapped again at no
    cost). Host tensors, and copies the engine made of a mapped tensor (onto another GPU), are
    not kept.

    torch opens a CUDA-IPC handle only when no live storage of this process maps it already
    (``torch.multiprocessing.reductions.shared_cache``, weak references): holding the last
    update's buckets makes the next update from the same sender buffers
    (:class:`rlinfer_core.transfer.arena.PackArena`) open nothing. ``keep_mapped(())`` lets them go.
    """
    from torch.multiprocessing.reductions import shared_cache

    held = {t.untyped_storage()._cdata for t in _MAPPED}
    mapped = {ref.cdata for ref in list(shared_cache.values())}
    kept = [t for t in tensors if t.device.type == "cuda" and t.untyped_storage()._cdata in mapped]
    reused = sum(1 for t in kept if t.untyped_storage()._cdata in held)
    _MAPPED[:] = kept
    return reused
