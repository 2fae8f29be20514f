"""The few NCCL calls a weight receiver needs, bound with ctypes to the NCCL torch loaded.

torch's own bindings of raw communicators (``torch.cuda.nccl.init_rank``) are a legacy API that
fails on current builds (torch 2.11, Python 3.12: "PY_SSIZE_T_CLEAN macro must be defined"), and
the engines' wrappers (vLLM's and SGLang's ``pynccl_wrapper``) cannot be imported by the core.
So this module binds ``ncclCommInitRank``, ``ncclAllReduce``, ``ncclBroadcast`` and
``ncclCommAbort`` of the ``libnccl.so.2`` already in the process (torch links it), the way those
wrappers do.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Any

from rlinfer_core.errors import WeightUpdateError

if TYPE_CHECKING:
    import torch

#: ncclDataType_t values (nccl.h)
_DTYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "int64": 4,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
_SUM = 0  #: ncclRedOp_t ncclSum
NCCL_UNIQUE_ID_BYTES = 128  #: NCCL_UNIQUE_ID_BYTES (nccl.h)


class UniqueId(ctypes.Structure):
    """NCCL's ``ncclUniqueId``: 128 opaque bytes, passed by value."""

    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def _library() -> ctypes.CDLL:
    import torch  # noqa: F401  (loads the libnccl.so.2 that torch links)

    name = os.environ.get("RLINFER_NCCL_SO_PATH", "libnccl.so.2")
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise WeightUpdateError(f"cannot load NCCL ({name}): {exc}; set RLINFER_NCCL_SO_PATH") from exc
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetErrorString.argtypes = [ctypes.c_int]
    lib.ncclCommInitRank.restype = ctypes.c_int
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    for fn, extra in (("ncclAllReduce", ctypes.c_int), ("ncclBroadcast", ctypes.c_int)):
        getattr(lib, fn).restype = ctypes.c_int
        # send, recv, count, datatype, op (all-reduce) or root (broadcast), comm, stream
        getattr(lib, fn).argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            extra,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
    lib.ncclCommAbort.restype = ctypes.c_int
    lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
    return lib


class NcclComm:
    """One rank's NCCL communicator (made from a unique id shared by rank 0)."""

    def __init__(self, world_size: int, unique_id: bytes, rank: int) -> None:
        self._lib = _library()
        uid = UniqueId()
        ctypes.memmove(uid.internal, unique_id, len(uid.internal))
        comm = ctypes.c_void_p()
        self._check(self._lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        self._comm: Any = comm

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            message = self._lib.ncclGetErrorString(result).decode(errors="replace")
            raise WeightUpdateError(f"{call} failed: {message} ({result})")

    def all_reduce_sum(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """In-place sum over all ranks, queued on ``stream``."""
        self._check(
            self._lib.ncclAllReduce(
                tensor.data_ptr(),
                tensor.data_ptr(),
                tensor.numel(),
                _dtype(tensor),
                _SUM,
                self._comm,
                stream.cuda_stream,
            ),
            "ncclAllReduce",
        )

    def broadcast(self, tensor: torch.Tensor, root: int, stream: torch.cuda.Stream) -> None:
        """Receive (or send, at ``root``) ``tensor`` in place, queued on ``stream``."""
        self._check(
            self._lib.ncclBroadcast(
                tensor.data_ptr(),
                tensor.data_ptr(),
                tensor.numel(),
                _dtype(tensor),
                root,
                self._comm,
                stream.cuda_stream,
            ),
            "ncclBroadcast",
        )

    def abort(self) -> None:
        """Tear the communicator down, also mid-collective (its kernels are cancelled)."""
        if self._comm is not None:
            self._lib.ncclCommAbort(self._comm)
            self._comm = None


def _dtype(tensor: torch.Tensor) -> int:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise WeightUpdateError(f"NCCL cannot carry {name} tensors here; known: {sorted(_DTYPES)}")
    return _DTYPES[name]
