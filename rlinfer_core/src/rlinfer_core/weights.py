"""Weight-update types: what a trainer hands to ``Engine.update_weights``.

A :class:`WeightUpdate` wraps one source:

- :class:`NamedTensors`: tensors in this process (colocated trainer). Backends whose engine runs
  in another process ship them through shared memory (CPU) or CUDA IPC (GPU).
- :class:`Buckets`: the same tensors flattened by :func:`rlinfer_core.transfer.buckets.pack`
  into per-dtype byte buffers with a manifest and checksum (fewer, larger transfers).
- :class:`CheckpointDir`: a directory of ``*.safetensors`` files (disk transport).
- :class:`BroadcastSource`: tensors broadcast from rank 0 of a group set up earlier with
  ``Engine.init_weight_broadcast`` (gloo on CPU, NCCL on GPU).

:class:`WeightDelta` is not a source of its own: ``update_weights(WeightDelta(...))`` checks its
``base_version`` against the engine's weight version and hands the backend the changed tensors as
a partial :class:`NamedTensors` update (capability ``weights.delta``; see :mod:`rlinfer_core.delta`
for the trainer side).

Names are Hugging Face checkpoint names (what ``model.named_parameters()`` of the HF model
gives); backends map them onto their engine's fused layout. This module never imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from rlinfer_core import _validate as v
from rlinfer_core.errors import InvalidRequest

if TYPE_CHECKING:
    import torch


@attrs.frozen
class TensorSpec:
    """Name, dtype (torch name without ``torch.``, e.g. ``"bfloat16"``) and shape of a tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=v.ints)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@attrs.frozen
class ManifestEntry:
    """Where one tensor lies inside a bucket's byte buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=v.ints)
    offset: int  #: byte offset into the bucket
    nbytes: int


@attrs.frozen
class BucketManifest:
    """Describes one bucket: all entries share ``dtype``; ``checksum`` covers the used bytes."""

    dtype: str
    nbytes: int
    entries: tuple[ManifestEntry, ...] = attrs.field(converter=v.to_tuple)
    checksum: str | None = None  #: hex digest (blake2b-128) of data[:nbytes]; None skips checks


@attrs.frozen
class Bucket:
    """A manifest and its flat ``uint8`` tensor (CPU or CUDA)."""

    manifest: BucketManifest
    data: torch.Tensor


@attrs.frozen
class NamedTensors:
    """(name, tensor) pairs living in this process."""

    tensors: tuple[tuple[str, torch.Tensor], ...] = attrs.field(converter=v.to_tuple)

    @classmethod
    def of(cls, items: Iterable[tuple[str, Any]] | dict[str, Any]) -> NamedTensors:
        """Build from a dict or an iterable of pairs (e.g. ``model.named_parameters()``)."""
        pairs = items.items() if isinstance(items, dict) else items
        return cls(tuple((str(k), t) for k, t in pairs))


@attrs.frozen
class Buckets:
    """Packed buckets (see :mod:`rlinfer_core.transfer.buckets`)."""

    buckets: tuple[Bucket, ...] = attrs.field(converter=v.to_tuple)


@attrs.frozen
class CheckpointDir:
    """A directory holding ``*.safetensors`` files with HF parameter names."""

    path: str


@attrs.frozen
class BroadcastSource:
    """Tensors broadcast by rank 0 of the weight group, one by one in ``specs`` order."""

    specs: tuple[TensorSpec, ...] = attrs.field(converter=v.to_tuple)


WeightSource = NamedTensors | Buckets | CheckpointDir | BroadcastSource


@attrs.frozen
class WeightDelta:
    """Only the tensors that changed since the engine's weight version ``base_version``.

    ``update_weights(delta)`` loads them only when the engine serves exactly ``base_version``
    (otherwise WeightUpdateError, nothing loaded); an empty delta is refused like an empty update.
    """

    base_version: int = attrs.field(validator=v.in_range(0, v.MAX_INT64, integer=True))
    tensors: tuple[tuple[str, torch.Tensor], ...] = attrs.field(converter=v.to_tuple)

    @classmethod
    def of(cls, base_version: int, items: Iterable[tuple[str, Any]] | dict[str, Any]) -> WeightDelta:
        """Build from a dict or an iterable of (name, tensor) pairs."""
        pairs = items.items() if isinstance(items, dict) else items
        return cls(base_version, tuple((str(k), t) for k, t in pairs))

    @property
    def nbytes(self) -> int:
        """Bytes the delta carries."""
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@attrs.frozen
class WeightUpdate:
    """A complete or partial weight update; applied all-or-nothing.

    ``version`` is the version the engine reports after success; None means current + 1.
    """

    source: WeightSource
    version: int | None = attrs.field(default=None, validator=v.in_range(0, v.MAX_INT64, integer=True, allow_none=True))

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.source, NamedTensors | Buckets | CheckpointDir | BroadcastSource):
            raise InvalidRequest("source", f"unknown weight source {type(self.source).__name__}")


@attrs.frozen
class BroadcastGroup:
    """A torch.distributed group between the trainer (rank 0) and the engine's workers.

    The engine's workers take ranks ``rank_offset`` .. ``rank_offset + ranks - 1`` (one per
    tensor-parallel worker; see ``AsyncEngine.broadcast_ranks``); with one engine that is
    1..world_size-1. A pool of engines gives each replica its own offset, so one broadcast from
    the trainer reaches every replica. ``backend`` is "gloo" (CPU) or "nccl" (GPU).
    """

    master_addr: str
    master_port: int = attrs.field(validator=v.in_range(1, 65535, integer=True))
    world_size: int = attrs.field(default=2, validator=v.in_range(2, 65536, integer=True))
    backend: Literal["gloo", "nccl"] = attrs.field(default="gloo", validator=v.one_of("gloo", "nccl"))
    group_name: str = "rlinfer-weights"
    timeout_s: float = attrs.field(default=120.0, validator=v.in_range(0.0, 3600.0, low_open=True))
    rank_offset: int = attrs.field(default=1, validator=v.in_range(1, 65535, integer=True))

    def __attrs_post_init__(self) -> None:
        if self.rank_offset >= self.world_size:
            raise InvalidRequest("rank_offset", f"must be < world_size ({self.world_size}), got {self.rank_offset}")


def specs_of(tensors: Sequence[tuple[str, Any]]) -> tuple[TensorSpec, ...]:
    """TensorSpecs of (name, tensor) pairs."""
    return tuple(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors)
