"""Where the kit's trainer holds the weights it sends, and proof of the path they took.

By default the kit's trainer holds CPU tensors and its broadcast group is gloo, which checks the
contract on any machine but never exercises the GPU paths. ``--rlinfer-trainer-device cuda:1``
puts the sent tensors on a GPU (tensors and buckets then reach a local engine through CUDA IPC,
which every such update asserts); ``--rlinfer-broadcast-backend nccl`` makes the broadcast group
NCCL (the trainer needs a GPU of its own: NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

#: read by the kit's worlds; set from the command line by the plugin
DEVICE_ENV = "RLINFER_KIT_TRAINER_DEVICE"
BROADCAST_BACKEND_ENV = "RLINFER_KIT_BROADCAST_BACKEND"


def device() -> str:
    """The device the kit's trainer holds its weights on (``--rlinfer-trainer-device``)."""
    return os.environ.get(DEVICE_ENV, "cpu")


def broadcast_backend() -> Literal["gloo", "nccl"]:
    """The backend of the kit's weight broadcast group (``--rlinfer-broadcast-backend``)."""
    return "nccl" if os.environ.get(BROADCAST_BACKEND_ENV) == "nccl" else "gloo"


def on_gpu() -> bool:
    """True when the kit's trainer holds its weights on a GPU."""
    return device().startswith("cuda")


def to_trainer(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors on the trainer's device (the same objects when that is the CPU)."""
    if not on_gpu():
        return list(tensors)
    return [(name, t.to(device())) for name, t in tensors]


def use_trainer_device() -> None:
    """Make the trainer's GPU this thread's current device (NCCL picks its device from it)."""
    if on_gpu():
        import torch

        torch.cuda.set_device(torch.device(device()))


@contextlib.contextmanager
def counting_cuda_ipc_handles() -> Iterator[Callable[[], int]]:
    """Count the CUDA IPC handles this process hands out while the block runs.

    torch's multiprocessing pickler shares a CUDA tensor by calling its storage's
    ``_share_cuda_``; every engine transport that sends CUDA tensors to another process on this
    host goes through it. A count of zero after a CUDA-tensor update means the tensors took
    another way (e.g. a copy to the host). The count is process-wide, so the block must not
    overlap another update.
    """
    import torch

    storage = torch.UntypedStorage
    original = storage._share_cuda_
    handles = 0

    def counted(self: torch.UntypedStorage, *args: object, **kwargs: object) -> object:
        nonlocal handles
        handles += 1
        return original(self, *args, **kwargs)  # type: ignore[no-untyped-call]

    storage._share_cuda_ = counted  # type: ignore[method-assign,assignment]
    try:
        yield lambda: handles
    finally:
        storage._share_cuda_ = original  # type: ignore[method-assign]
