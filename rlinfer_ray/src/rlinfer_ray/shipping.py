"""The trainer's tensors in Ray's object store as raw bytes, read by the replicas without a copy.

Ray pickles a torch tensor: one copy into the pickle on ``ray.put``, another out of it in every
reader. It stores a numpy array out of band instead: ``put`` writes its bytes once into the node's
shared memory and a reader on that node maps them. For 1.26 GB of bf16 weights (2-core CPU,
Ray 2.60) a pickled put + get took 7.7-13 s, the same bytes as numpy arrays 0.1-0.8 s; on the
H100 a pool update by tensors took 7.0 s against 0.66 s for the engine alone
(``bench/results/gpu-h100-2026-11-23-session8``).

Ray has the same trick for tensors behind ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``, but that switch
is read once when Ray is imported and changes every tensor the process sends through Ray (the
trainer's own, too). :class:`ShippedWeights` does it for the pool's weight updates only: it
pickles to the tensors' bytes as ``uint8`` numpy arrays, and unpickles straight into the
:class:`~rlinfer_core.weights.NamedTensors` / :class:`~rlinfer_core.weights.Buckets` it wraps,
on the host, their storage the object store's shared memory (read-only: the engines only read
the tensors they load).
"""

from __future__ import annotations

import warnings
from typing import Any

import attrs

from rlinfer_core.transfer.buckets import as_bytes, dtype_name, to_dtype
from rlinfer_core.weights import Buckets, NamedTensors


@attrs.frozen
class ShippedWeights:
    """``source`` as the pool puts it in Ray's object store; a reader gets ``source`` back
    (every tensor on the host)."""

    source: NamedTensors | Buckets

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if isinstance(self.source, NamedTensors):
            names = [name for name, _ in self.source.tensors]
            return _named_tensors, (names, [_raw(t) for _, t in self.source.tensors])
        manifests = [b.manifest for b in self.source.buckets]
        return _buckets, (manifests, [_raw(b.data) for b in self.source.buckets])


def _raw(tensor: Any) -> tuple[Any, str, tuple[int, ...]]:
    """(the tensor's bytes as a uint8 numpy array, its dtype's name, its shape); a CUDA tensor is
    copied to the host first (each replica sees its own GPUs only)."""
    return as_bytes(tensor).cpu().numpy(), dtype_name(tensor.dtype), tuple(tensor.shape)


def _tensor(raw: tuple[Any, str, tuple[int, ...]]) -> Any:
    import torch

    data, dtype, shape = raw
    with warnings.catch_warnings():  # the object store's arrays are read-only; torch warns about that
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(data)
    return flat.view(to_dtype(dtype)).reshape(shape)


def _named_tensors(names: list[str], raws: list[tuple[Any, str, tuple[int, ...]]]) -> NamedTensors:
    return NamedTensors(tuple((name, _tensor(raw)) for name, raw in zip(names, raws, strict=True)))


def _buckets(manifests: list[Any], raws: list[tuple[Any, str, tuple[int, ...]]]) -> Buckets:
    from rlinfer_core.weights import Bucket

    return Buckets(tuple(Bucket(m, _tensor(raw)) for m, raw in zip(manifests, raws, strict=True)))
