"""Pack buffers reused from one weight update to the next (the sender's half of a CUDA-IPC
transfer that maps nothing new after the first update).

A receiver opens one CUDA-IPC handle per buffer it is sent (issue 29 suspected that of a 4.5 ms
"mapping" step; on the H100 it was not: bench/results/gpu-h100-2026-11-26-ipc-reuse). torch's
receiving side already skips the open when it still holds a live storage for the same ``(handle, offset)``
(``torch.multiprocessing.reductions.rebuild_cuda_tensor`` and its ``shared_cache``). So when the
sender shares the *same* allocation every update (:class:`PackArena`) and the receiver keeps what
it mapped alive between updates (:func:`rlinfer_core.transfer.ipc.keep_mapped`), the second and
later updates of a layout map nothing; packing becomes one batched copy into
buffers that already exist (H100, 1.26 GB: 2.4 ms instead of 2.8-3.9 ms; the receiver's map step
stayed ~2 ms, which is not the handles).

The cost: the buffers of the last update stay allocated (one packed copy of it on the sender's
device) until the layout changes or :meth:`PackArena.clear`. For at most ~1 ms of a 13 ms update
that is a whole model copy on a trainer's GPU, so the backends reuse buffers only when
``RLINFER_REUSE_IPC_BUFFERS=1`` is in the trainer's environment (:func:`engine_arena`); by default
they pack fresh buffers for every update, as without an arena.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import attrs

from rlinfer_core.transfer.buckets import DEFAULT_BUCKET_BYTES, checksum, pack
from rlinfer_core.weights import Bucket

if TYPE_CHECKING:
    import torch

#: the trainer's environment variable that turns buffer reuse on ("1"; off by default)
REUSE_ENV = "RLINFER_REUSE_IPC_BUFFERS"

#: what makes two updates pack into the same buffers: every (name, dtype, shape, device) in
#: order, the target device and the bucket size
Layout = tuple[tuple[tuple[str, "torch.dtype", "torch.Size", "torch.device"], ...], str, int]


class PackArena:
    """Owns the pack buffers of the last update and reuses them for an update of the same layout.

    The caller must not pack again while a receiver may still read the buffers: an engine
    backend packs inside its serialized weight calls, and every receiver copies out of the
    buffers before its call returns (``sending`` forgets them when a call does not return).
    """

    def __init__(self, keep: bool = True) -> None:
        #: False: every pack gets fresh buffers and the arena holds none (the opt-out)
        self.keep = keep
        self._layout: Layout | None = None
        self._buckets: list[Bucket] = []
        #: one slot (a view into a bucket) per input tensor, in input order
        self._slots: list[torch.Tensor] = []
        #: how many packs reused the buffers (for tests and benches)
        self.reuses = 0
        #: whether anything was packed here, so a receiver may hold mapped buffers (see close)
        self.packed = False

    @property
    def nbytes(self) -> int:
        """Bytes the arena holds."""
        return sum(b.data.numel() for b in self._buckets)

    def pack(
        self,
        tensors: Sequence[tuple[str, torch.Tensor]],
        max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        with_checksum: bool | None = None,
        device: torch.device | str | None = None,
    ) -> list[Bucket]:
        """:func:`rlinfer_core.transfer.buckets.pack` of ``tensors``, into the buffers of the last
        pack when the layout is the same (one ``torch._foreach_copy_``; the same storages), else
        into fresh buffers that replace them (the old ones are dropped first)."""
        self.packed = True
        layout = _layout(tensors, max_bucket_bytes, device)
        if layout is not None and layout == self._layout:
            import torch

            with torch.no_grad():
                torch._foreach_copy_(self._slots, [t for _, t in tensors])
            self.reuses += 1
            return [_rechecked(b) for b in self._buckets]
        self.clear()
        buckets = pack(tensors, max_bucket_bytes, with_checksum=with_checksum, device=device)
        if layout is not None and self.keep:  # names repeat: nothing to map the slots by
            self._layout, self._buckets, self._slots = layout, buckets, _slots(buckets, tensors)
        return buckets

    def clear(self) -> None:
        """Drop the buffers (a receiver still holding them keeps them alive until it lets go)."""
        self._layout, self._buckets, self._slots = None, [], []

    async def close(self, receiver_lets_go: Callable[[], Awaitable[object]], timeout_s: float = 10.0) -> None:
        """At engine shutdown, while the engine still runs: have the receiver drop the buffers it
        keeps mapped (``receiver_lets_go``, best effort, only if anything was packed here), then
        clear. torch frees a shared buffer only once every receiver that mapped it let go: one
        that is killed holding it would leave it allocated on the sender's GPU for good. (An
        arena that keeps nothing asks the receiver to keep nothing either: no call.)"""
        if self.packed and self.keep:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(receiver_lets_go(), timeout_s)
        self.clear()

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Wrap the call that hands the packed buckets to the receiver: when it raises or is
        cancelled, the receiver may still be reading them, so the next pack must not overwrite
        them: the arena forgets them (torch frees them once the receiver lets go)."""
        try:
            yield
        except BaseException:
            self.clear()
            raise


def engine_arena() -> PackArena:
    """A backend's arena for its engine: one that keeps its buffers when
    ``RLINFER_REUSE_IPC_BUFFERS=1``, else one that keeps nothing (fresh buffers for every update,
    as without an arena)."""
    return PackArena(keep=os.environ.get(REUSE_ENV, "0").strip() == "1")


def _layout(
    tensors: Sequence[tuple[str, torch.Tensor]], max_bucket_bytes: int, device: torch.device | str | None
) -> Layout | None:
    """The update's layout; None where a name repeats."""
    if len({name for name, _ in tensors}) != len(tensors):
        return None
    parts = tuple((name, t.dtype, t.shape, t.device) for name, t in tensors)
    return parts, str(device), max_bucket_bytes


def _slots(buckets: Sequence[Bucket], tensors: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each input tensor's place in the buckets (a view of its dtype and shape), in input order."""
    from rlinfer_core.transfer.buckets import unpack_all

    where = dict(unpack_all(buckets, check=False))
    return [where[name] for name, _ in tensors]


def _rechecked(bucket: Bucket) -> Bucket:
    """The bucket with its checksum computed over the new bytes (where it has one)."""
    if bucket.manifest.checksum is None:
        return bucket
    digest = checksum(bucket.data, bucket.manifest.nbytes)
    return Bucket(attrs.evolve(bucket.manifest, checksum=digest), bucket.data)


__all__ = ["REUSE_ENV", "PackArena", "engine_arena"]
