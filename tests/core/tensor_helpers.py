"""Tensor helpers shared by the core unit tests."""

from __future__ import annotations

from typing import Any


def make_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> Any:
    """A deterministic tensor of any supported dtype (floats: normal values; ints: wide range)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)
