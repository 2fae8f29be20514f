"""Batched device copies at full memory bandwidth.

``torch._foreach_copy_`` copies a list of tensors with a few multi-tensor kernels, but each
thread moves a handful of *elements*: one-byte elements (the uint8 views that pack tensors into
buckets) move a quarter as many bytes per launch as eight-byte ones, and a 1.26 GB update then
costs several times the one-copy floor. :func:`copy_all` reinterprets every pair whose bytes
allow it as 8-byte words first (a view, no copy), so the same kernels move 8 bytes per element
whatever the dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the widest element the copy kernels move per thread and iteration
WORD_BYTES = 8


def as_words(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s bytes as a 1-D int64 view, or None when it is not contiguous or its size or
    start is not a multiple of :data:`WORD_BYTES`."""
    import torch

    nbytes = tensor.nbytes
    if nbytes % WORD_BYTES or not nbytes or tensor.data_ptr() % WORD_BYTES or not tensor.is_contiguous():
        return None
    if tensor.dim() != 1:
        tensor = tensor.view(-1)
    if tensor.dtype == torch.int64:
        return tensor
    return (tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)).view(torch.int64)


def copy_all(dests: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], non_blocking: bool = True) -> None:
    """Copy the bytes of every ``src`` into its ``dest`` (the same number of bytes; the same
    dtype, or a contiguous ``uint8`` ``dest`` taking any ``src``'s bytes, as in a bucket),
    batched: pairs that are both word views (:func:`as_words`) in one ``torch._foreach_copy_``
    over int64, the rest in one over their own dtypes (bytes where the dtypes or shapes differ)."""
    import torch

    from rlinfer_core.transfer.buckets import as_bytes

    wide_dests, wide_srcs, dests_left, srcs_left = [], [], [], []
    for dest, src in zip(dests, srcs, strict=True):
        if not src.numel() and not dest.numel():
            continue
        dest_words, src_words = as_words(dest), as_words(src)
        if dest_words is not None and src_words is not None:
            if dest_words.numel() != src_words.numel():
                sizes = src_words.numel() * WORD_BYTES, dest_words.numel() * WORD_BYTES
                raise ValueError(f"copy of {sizes[0]} bytes into {sizes[1]}")
            wide_dests.append(dest_words)
            wide_srcs.append(src_words)
        elif dest.dtype == src.dtype and dest.shape == src.shape:
            dests_left.append(dest)
            srcs_left.append(src)
        else:
            if not dest.is_contiguous():
                raise ValueError("a byte copy needs a contiguous destination")
            dests_left.append(as_bytes(dest))
            srcs_left.append(as_bytes(src))
    with torch.no_grad():
        if wide_dests:
            torch._foreach_copy_(wide_dests, wide_srcs, non_blocking=non_blocking)
        if dests_left:
            torch._foreach_copy_(dests_left, srcs_left, non_blocking=non_blocking)
