"""vLLM's weight-transfer wire, receiver side, without vLLM.

vLLM's trainer side (``NCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights``, and
TRL's ``VLLMClient`` over it) builds its group as a ``StatelessProcessGroup``: rank 0 hosts a
``TCPStore`` at ``master_address:master_port`` and pickles its ``ncclUniqueId`` under the store
key ``broadcast_from/0/0``; every rank then calls ``ncclCommInitRank`` and a one-element float32
``all_reduce`` (the warm-up every peer must match). vLLM >= 0.28 may instead hand the unique id
over HTTP (``nccl_unique_id_b64``, no store). Tensors then follow as NCCL broadcasts from rank 0:
one per tensor, or **packed** — uint8 buffers holding consecutive tensors, a buffer closed as soon
as its size exceeds ``packed_buffer_size_bytes`` (``vllm/distributed/weight_transfer/
packed_tensor.py``: ``pack_tensors``), so the receiver cuts the same buffers from the names,
dtypes and shapes alone.

This module joins such a group with ``torch.distributed.TCPStore`` and NCCL itself
(:mod:`rlinfer_core.transfer.nccl_lib`), so
``rlinfer serve --dialect vllm`` receives from vLLM's trainer side unchanged whichever engine it
serves (the SGLang environment has no vLLM). The packing rules are transport-independent:
:func:`receive_tensors` also reads packed buffers from a gloo group (rlinfer's CPU variant).
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rlinfer_core.errors import EngineTimeout, InvalidRequest, WeightUpdateError
from rlinfer_core.transfer.nccl_lib import UniqueId
from rlinfer_core.weights import TensorSpec

if TYPE_CHECKING:
    import torch

    from rlinfer_core.transfer.nccl_lib import NcclComm

#: vLLM's defaults for packed transfers (both sides must agree)
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
#: where vLLM's rank 0 leaves the pickled ncclUniqueId (StatelessProcessGroup.broadcast_obj, first call)
UNIQUE_ID_KEY = "broadcast_from/0/0"


class Receiver(Protocol):
    """One side of a group that receives rank 0's broadcasts into preallocated tensors."""

    def receive_into(self, tensor: torch.Tensor, deadline: float) -> None:
        """Fill ``tensor`` with rank 0's next broadcast, or raise EngineTimeout at ``deadline``
        (``time.monotonic()`` seconds)."""

    @property
    def device(self) -> torch.device:
        """Where received tensors must live."""

    def close(self) -> None:
        """Leave the group."""


def packed_chunks(specs: Sequence[TensorSpec], buffer_size_bytes: int) -> list[tuple[TensorSpec, ...]]:
    """The buffers vLLM's packer sends for ``specs``: a tensor is appended, then the buffer is
    closed once its size exceeds ``buffer_size_bytes`` (so one tensor larger than that travels
    alone, and every buffer but the last ends with the tensor that crossed the limit)."""
    chunks: list[tuple[TensorSpec, ...]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        current.append(spec)
        size += nbytes(spec)
        if size > buffer_size_bytes:
            chunks.append(tuple(current))
            current, size = [], 0
    if current:
        chunks.append(tuple(current))
    return chunks


def nbytes(spec: TensorSpec) -> int:
    """Bytes of one tensor of ``spec``."""
    import torch

    from rlinfer_core.transfer.buckets import to_dtype

    return spec.numel * torch.empty((), dtype=to_dtype(spec.dtype)).element_size()


def receive_tensors(
    receiver: Receiver, specs: Sequence[TensorSpec], packed_buffer_size_bytes: int | None, timeout_s: float
) -> list[tuple[str, torch.Tensor]]:
    """Receive ``specs`` (one broadcast per tensor, or packed when a buffer size is given) and
    return them as CPU tensors, in order."""
    import torch

    from rlinfer_core.transfer.buckets import to_dtype

    deadline = time.monotonic() + timeout_s
    out: list[tuple[str, torch.Tensor]] = []
    if packed_buffer_size_bytes is None:
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=to_dtype(spec.dtype), device=receiver.device)
            receiver.receive_into(tensor, deadline)
            out.append((spec.name, tensor.cpu()))
        return out
    for chunk in packed_chunks(specs, packed_buffer_size_bytes):
        sizes = [nbytes(s) for s in chunk]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=receiver.device)
        receiver.receive_into(buffer, deadline)
        host = buffer.cpu()
        for spec, part in zip(chunk, torch.split(host, sizes), strict=True):
            out.append((spec.name, part.view(to_dtype(spec.dtype)).view(spec.shape).clone()))
    return out


class _UniqueIdUnpickler(pickle.Unpickler):
    """Reads vLLM's pickled ``ncclUniqueId`` without importing vLLM, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "ncclUniqueId" and module.endswith("pynccl_wrapper"):
            return UniqueId
        if (module, name) == ("_ctypes", "_unpickle"):
            import _ctypes

            return _ctypes._unpickle  # type: ignore[attr-defined]
        raise pickle.UnpicklingError(f"unexpected object in the NCCL rendezvous: {module}.{name}")


def unique_id_from_store(payload: bytes) -> bytes:
    """The 128 unique-id bytes from vLLM's pickled ``ncclUniqueId``."""
    uid = _UniqueIdUnpickler(io.BytesIO(payload)).load()
    if not isinstance(uid, UniqueId):
        raise WeightUpdateError(f"the NCCL rendezvous holds a {type(uid).__name__}, not an ncclUniqueId")
    return bytes(uid.internal)


class VllmNcclReceiver:
    """A rank of vLLM's NCCL weight group (never rank 0, where vLLM's trainer sits), joined with
    torch's TCPStore and NCCL bound by :mod:`rlinfer_core.transfer.nccl_lib`."""

    def __init__(self, comm: NcclComm, device: torch.device) -> None:
        import torch

        self._comm: NcclComm | None = comm
        self._device = device
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @property
    def device(self) -> torch.device:
        """The CUDA device the communicator was made on."""
        return self._device

    @classmethod
    def join(
        cls,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        master_address: str | None = None,
        master_port: int | None = None,
        unique_id: bytes | None = None,
    ) -> VllmNcclReceiver:
        """Join as ``rank``: read rank 0's unique id from its store (or take it as given), make
        the communicator and run vLLM's warm-up all-reduce."""
        import torch
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        from rlinfer_core.transfer.nccl_lib import NcclComm

        if not torch.cuda.is_available():
            raise InvalidRequest("init_info.backend", "vLLM's NCCL weight transfer needs a CUDA device: use gloo")
        if unique_id is None:
            if master_address is None or master_port is None:
                raise InvalidRequest("init_info.master_address", "give master_address and master_port, or a unique id")
            store = TCPStore(
                host_name=master_address,
                port=master_port,
                world_size=world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
                use_libuv=False,
            )
            unique_id = unique_id_from_store(store.get(UNIQUE_ID_KEY))
        # vLLM sets NCCL_CUMEM_ENABLE=0 process-wide on import (vllm/env_override.py), so its
        # trainer side sets up P2P buffers without cuMem; a peer with cuMem on fails in the P2P
        # transport ("Cuda failure 'invalid argument'", measured on 2 H100s). NCCL reads it at
        # the process's first communicator.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(device):
            receiver = cls(NcclComm(world_size, unique_id, rank), device)
            warm_up = torch.zeros(1, device=device)
            receiver._comm_or_raise().all_reduce_sum(warm_up, receiver._stream)
            receiver._wait(time.monotonic() + timeout_s)
        return receiver

    def _comm_or_raise(self) -> NcclComm:
        if self._comm is None:
            raise WeightUpdateError("the weight group was closed: POST /init_weight_transfer_engine")
        return self._comm

    def receive_into(self, tensor: torch.Tensor, deadline: float) -> None:
        """Fill ``tensor`` from rank 0's next broadcast (on a side stream, polled against the
        deadline so a trainer that died leaves an error, not a hung request)."""
        import torch

        with torch.cuda.device(self._device):
            self._comm_or_raise().broadcast(tensor, 0, self._stream)
        self._wait(deadline)

    def _wait(self, deadline: float) -> None:
        event = self._stream.record_event()
        while not event.query():
            if time.monotonic() > deadline:
                self.close()
                raise EngineTimeout("the trainer's NCCL broadcast did not arrive before the deadline")
            time.sleep(0.0005)

    def close(self) -> None:
        """Abort the communicator (also cancels a broadcast still waiting for the trainer)."""
        if self._comm is not None:
            self._comm.abort()
            self._comm = None
