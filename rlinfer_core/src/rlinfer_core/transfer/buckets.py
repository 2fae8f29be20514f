"""Flatten named tensors into per-dtype buckets of bounded size, and back.

A bucket is one flat ``uint8`` tensor plus a :class:`BucketManifest` that says where each tensor
lies (name, dtype, shape, byte offset, byte size) and a checksum of the bytes. All entries of a
bucket share one dtype, so every offset is a multiple of the itemsize and unpacking returns
zero-copy views. Fewer, larger buffers make shared-memory, IPC and broadcast transfers cheap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.weights import Bucket, BucketManifest, ManifestEntry

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 512 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises WeightUpdateError for unknown names."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}")
    return dtype


def checksum(data: torch.Tensor, nbytes: int) -> str:
    """blake2b-128 hex digest of the first ``nbytes`` bytes of a flat uint8 tensor."""
    flat = data[:nbytes]
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return hashlib.blake2b(flat.numpy().tobytes() if nbytes else b"", digest_size=16).hexdigest()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat ``uint8`` tensor on its device (a view where it is contiguous)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat.view(torch.uint8)


def pack(
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    with_checksum: bool | None = None,
    device: torch.device | str | None = None,
) -> list[Bucket]:
    """Pack (name, tensor) pairs into buckets of at most ``max_bucket_bytes`` (a single tensor
    larger than that gets a bucket of its own). Buckets keep the input order within a dtype.

    ``with_checksum`` defaults to True for CPU buckets and False for CUDA ones (hashing would
    copy them to the host). ``device`` defaults to the tensors' device.
    """
    import torch

    if max_bucket_bytes <= 0:
        raise ValueError("max_bucket_bytes must be positive")
    groups: dict[torch.dtype, list[list[tuple[str, torch.Tensor]]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        chunks = groups.setdefault(tensor.dtype, [[]])
        if chunks[-1] and sizes[tensor.dtype] + nbytes > max_bucket_bytes:
            chunks.append([])
            sizes[tensor.dtype] = 0
        chunks[-1].append((name, tensor))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + nbytes
    buckets = []
    for dtype, chunks in groups.items():
        for chunk in chunks:
            target = torch.device(device) if device is not None else chunk[0][1].device
            numels = [t.numel() for _, t in chunk]
            itemsize = chunk[0][1].element_size()
            data = torch.empty(sum(numels) * itemsize, dtype=torch.uint8, device=target)
            # typed views of the buffer shaped like the tensors: one multi-tensor copy, and no
            # per-tensor byte view of the sources (each view is a Python-level torch call)
            slots = [
                s.view(t.shape) for s, (_, t) in zip(data.view(dtype).split_with_sizes(numels), chunk, strict=True)
            ]
            with torch.no_grad():
                torch._foreach_copy_(slots, [t for _, t in chunk])  # a few kernels for the whole bucket on a GPU
            entries, offset = [], 0
            name_of_dtype = dtype_name(dtype)
            for (name, tensor), numel in zip(chunk, numels, strict=True):
                entries.append(ManifestEntry(name, name_of_dtype, tuple(tensor.shape), offset, numel * itemsize))
                offset += numel * itemsize
            use_checksum = (target.type == "cpu") if with_checksum is None else with_checksum
            digest = checksum(data, offset) if use_checksum else None
            buckets.append(Bucket(BucketManifest(name_of_dtype, offset, tuple(entries), digest), data))
    return buckets


def verify(bucket: Bucket) -> None:
    """Check the manifest is consistent with the buffer and the checksum matches.

    Raises WeightUpdateError listing every problem (truncated buffer, overlapping or
    out-of-range entries, wrong sizes, checksum mismatch).
    """
    import torch

    m = bucket.manifest
    data = bucket.data
    problems: list[str] = []
    if data.dtype != torch.uint8 or data.dim() != 1:
        problems.append(f"bucket data must be a 1-D uint8 tensor, got {data.dtype} with shape {tuple(data.shape)}")
        raise WeightUpdateError("corrupt bucket", tuple(problems))
    if data.numel() < m.nbytes:
        problems.append(f"bucket truncated: manifest says {m.nbytes} bytes, buffer has {data.numel()}")
    try:
        itemsize = to_dtype(m.dtype).itemsize
    except WeightUpdateError as exc:
        raise WeightUpdateError("corrupt bucket", (str(exc),)) from None
    end = 0
    for e in m.entries:
        numel = 1
        for d in e.shape:
            numel *= d
        if e.dtype != m.dtype:
            problems.append(f"{e.name}: dtype {e.dtype} differs from the bucket's {m.dtype}")
        if e.nbytes != numel * itemsize:
            problems.append(f"{e.name}: {e.nbytes} bytes do not fit shape {e.shape} of {m.dtype}")
        if e.offset < end or e.offset % itemsize:
            problems.append(f"{e.name}: offset {e.offset} overlaps the previous entry or is misaligned")
        end = e.offset + e.nbytes
        if end > m.nbytes:
            problems.append(f"{e.name}: bytes [{e.offset}, {end}) run past the bucket's {m.nbytes} bytes")
    if problems:
        raise WeightUpdateError("corrupt bucket", tuple(problems))
    if m.checksum is not None and checksum(data, m.nbytes) != m.checksum:
        raise WeightUpdateError("corrupt bucket", ("checksum mismatch: the bytes changed after packing",))


def unpack(bucket: Bucket, *, check: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Return (name, tensor) views into the bucket; ``check`` runs :func:`verify` first."""
    if check:
        verify(bucket)
    dtype = to_dtype(bucket.manifest.dtype)
    entries = bucket.manifest.entries
    itemsize = dtype.itemsize
    ends = [e.offset + e.nbytes for e in entries]
    back_to_back = [e.offset for e in entries] == [0, *ends[:-1]] and all(e.nbytes % itemsize == 0 for e in entries)
    if entries and back_to_back and ends[-1] <= bucket.data.numel():
        # back to back from the start (as pack writes them): one split of a typed view
        typed = bucket.data[: ends[-1]].view(dtype)
        parts = typed.split_with_sizes([e.nbytes // itemsize for e in entries])
        return [(e.name, part.view(e.shape)) for e, part in zip(entries, parts, strict=True)]
    out = []
    for e in entries:
        raw = bucket.data[e.offset : e.offset + e.nbytes]
        out.append((e.name, raw.view(dtype).reshape(e.shape)))
    return out


def unpack_all(buckets: Sequence[Bucket], *, check: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Unpack several buckets, in order."""
    return [pair for bucket in buckets for pair in unpack(bucket, check=check)]
