"""Share tensors with another process on the same host without copying them.

CPU tensors move into shared memory, CUDA tensors travel as CUDA IPC handles; both through
torch.multiprocessing's pickling reductions. :func:`dumps` gives bytes any RPC can carry;
:func:`loads` in the receiving process maps the same memory back. The sender must keep its
tensors alive until the receiver is done with them.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
            t = t.contiguous().share_memory_()  # type: ignore[no-untyped-call]
        shared.append((name, t))
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(shared)
    return buf.getvalue()


def loads(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    """Map tensors serialized by :func:`dumps` (in another process) into this one."""
    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    result: list[tuple[str, torch.Tensor]] = pickle.loads(payload)
    return result
