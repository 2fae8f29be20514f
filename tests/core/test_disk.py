"""Disk transport: safetensors directories round-trip, shard, and fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensor_helpers import make_tensor

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.transfer.disk import read_specs, read_tensors, save_dir
from rlinfer_core.weights import specs_of

DTYPES = ["float32", "bfloat16", "float16", "int64", "int32", "uint8", "bool"]


def tensors() -> list[tuple[str, torch.Tensor]]:
    return [(f"p.{d}.{i}", make_tensor(d, (3, 5 + i), i)) for i, d in enumerate(DTYPES)] + [
        ("p.scalar", torch.tensor(2.5)),
        ("p.empty", torch.empty(0, 4)),
    ]


def test_round_trip_one_shard(tmp_path: Path) -> None:
    src = tensors()
    out = save_dir(src, tmp_path / "ckpt")
    assert [p.name for p in out.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    got = dict(read_tensors(out))
    assert set(got) == {n for n, _ in src}
    for name, t in src:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert read_specs(out) == {s.name: s for s in specs_of(src)}


def test_sharding_and_index(tmp_path: Path) -> None:
    src = tensors()
    out = save_dir(src, tmp_path / "ckpt", max_shard_bytes=64)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in src}
    assert set(index["weight_map"].values()) == set(files)
    got = dict(read_tensors(out))
    for name, t in src:
        assert torch.equal(got[name], t), name
    assert read_specs(out) == {s.name: s for s in specs_of(src)}


def test_missing_directory(tmp_path: Path) -> None:
    for fn in (read_tensors, read_specs):
        with pytest.raises(WeightUpdateError, match="does not exist"):
            fn(tmp_path / "nope")


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "README").write_text("x")
    with pytest.raises(WeightUpdateError, match=r"no \*\.safetensors"):
        read_tensors(tmp_path)


def test_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    for fn in (read_tensors, read_specs):
        with pytest.raises(WeightUpdateError, match=r"unreadable safetensors file model\.safetensors"):
            fn(tmp_path)
