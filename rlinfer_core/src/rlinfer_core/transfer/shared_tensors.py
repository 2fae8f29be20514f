"""Named tensors handed over by reference, as SGLang's ``/update_weights_from_tensor`` takes them.

SGLang's trainers (slime's colocated mode, ``sglang.srt.utils.MultiprocessingSerializer``) pickle
a list of ``(name, tensor)`` with ``multiprocessing.reduction.ForkingPickler``: torch's
reductions put a CPU tensor's storage in shared memory and a CUDA tensor's behind a CUDA IPC
handle, so only handles travel. :func:`load_named_tensors` reads such a payload with an unpickler
that admits torch's rebuild functions, tensor and storage types and dtypes, and nothing else
(the same closed list idea as SGLang's ``SafeUnpickler``), then copies the tensors so the
trainer's memory may be reused once the call returns.

Between unrelated processes, CPU storages travel only with torch's ``file_system`` sharing
strategy (``torch.multiprocessing.set_sharing_strategy("file_system")`` in the trainer): the
default ``file_descriptor`` strategy passes descriptors over a connection keyed by the sender's
process authkey, which another process cannot open; such a payload is refused with that advice.
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

from rlinfer_core.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

_REBUILDS = frozenset(
    {
        "rebuild_tensor",
        "rebuild_typed_storage",
        "rebuild_storage_filename",
        "rebuild_cuda_tensor",
        "rebuild_storage_empty",
    }
)
_TORCH_TYPES = frozenset({"Tensor", "Size", "device"})
_STORAGES = frozenset({"UntypedStorage", "TypedStorage"})
_DESCRIPTOR_STRATEGY = frozenset({"rebuild_storage_fd", "DupFd", "rebuild_typed_storage_child"})


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch
        import torch.multiprocessing.reductions as reductions

        if module == "torch.multiprocessing.reductions" and name in _REBUILDS:
            return getattr(reductions, name)
        if module == "torch" and (name in _TORCH_TYPES or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.storage" and name in _STORAGES:
            return getattr(torch.storage, name)
        if module in ("builtins", "collections") and name in ("list", "tuple", "dict", "OrderedDict"):
            return getattr(__import__(module), name)
        if name in _DESCRIPTOR_STRATEGY:
            raise InvalidRequest(
                "serialized_named_tensors",
                "CPU tensors shared by file descriptor cannot be opened by another process: "
                "call torch.multiprocessing.set_sharing_strategy('file_system') in the trainer",
            )
        raise InvalidRequest("serialized_named_tensors", f"refused object in the payload: {module}.{name}")


def load_named_tensors(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one payload, copied out of the sender's memory."""
    import torch
    import torch.multiprocessing  # registers torch's reductions

    try:
        loaded = _HandleUnpickler(io.BytesIO(payload)).load()
    except InvalidRequest:
        raise
    except Exception as exc:  # a payload that is not a pickle, or a handle that cannot be opened
        raise InvalidRequest("serialized_named_tensors", f"cannot read the payload: {exc}") from exc
    if not isinstance(loaded, list | tuple) or not all(
        isinstance(item, list | tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in loaded
    ):
        raise InvalidRequest("serialized_named_tensors", "must hold a list of (name, tensor) pairs")
    return [(name, tensor.detach().clone()) for name, tensor in loaded]
