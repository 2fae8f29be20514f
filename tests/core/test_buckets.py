"""Bucket packing: identity for any dtype mix and shape, bounded sizes, corruption detected."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensor_helpers import make_tensor

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.transfer.buckets import pack, unpack, unpack_all, verify
from rlinfer_core.weights import Bucket

DTYPES = ["float32", "bfloat16", "float16", "int64", "int32", "uint8", "bool"]

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)  # () is 0-d, a 0 is empty


@st.composite
def named_tensors(draw: st.DrawFn) -> list[tuple[str, torch.Tensor]]:
    specs = draw(st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=12))
    seed = draw(st.integers(0, 2**16))
    return [(f"layer.{i}.w", make_tensor(d, s, seed + i)) for i, (d, s) in enumerate(specs)]


@settings(max_examples=120, deadline=None)
@given(named_tensors(), st.integers(1, 600))
def test_pack_unpack_is_identity_and_buckets_respect_the_limit(
    tensors: list[tuple[str, torch.Tensor]], limit: int
) -> None:
    buckets = pack(tensors, max_bucket_bytes=limit)
    out = unpack_all(buckets)
    assert sorted(n for n, _ in out) == sorted(n for n, _ in tensors)
    got = dict(out)
    for name, t in tensors:
        assert got[name].dtype == t.dtype
        assert tuple(got[name].shape) == tuple(t.shape)
        assert torch.equal(got[name], t), name
    for b in buckets:
        m = b.manifest
        assert m.nbytes == b.data.numel()
        assert all(e.dtype == m.dtype for e in m.entries)
        assert m.nbytes <= limit or len(m.entries) == 1, (m.nbytes, limit, len(m.entries))
    # within one dtype, input order is kept
    for dtype in DTYPES:
        want = [n for n, t in tensors if str(t.dtype) == f"torch.{dtype}"]
        assert [n for n, t in out if str(t.dtype) == f"torch.{dtype}"] == want


def test_unpack_returns_views_into_the_bucket() -> None:
    (bucket,) = pack([("a", torch.zeros(4)), ("b", torch.ones(2))])
    (_, a), (_, b) = unpack(bucket)
    bucket.data[:4].copy_(torch.tensor([1.0]).view(torch.uint8))
    assert a[0].item() == 1.0
    assert b.tolist() == [1.0, 1.0]


@pytest.fixture
def bucket() -> Bucket:
    (b,) = pack([("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(4))])
    return b


def _problems(b: Bucket) -> str:
    with pytest.raises(WeightUpdateError) as info:
        verify(b)
    with pytest.raises(WeightUpdateError):
        unpack(b)
    return "\n".join(info.value.problems)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_flipped_byte_fails_the_checksum(data: st.DataObject) -> None:
    (b,) = pack([("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(4))])
    pos = data.draw(st.integers(0, b.manifest.nbytes - 1))
    flip = data.draw(st.integers(1, 255))
    b.data[pos] ^= flip
    assert "checksum mismatch" in _problems(b)


def test_truncated_buffer(bucket: Bucket) -> None:
    short = Bucket(bucket.manifest, bucket.data[:-3].clone())
    assert "truncated" in _problems(short)


def test_wrong_buffer_type(bucket: Bucket) -> None:
    assert "1-D uint8" in _problems(Bucket(bucket.manifest, bucket.data.view(torch.float32)))


def test_overlapping_entries(bucket: Bucket) -> None:
    a, b = bucket.manifest.entries
    bad = attrs.evolve(bucket.manifest, entries=(a, attrs.evolve(b, offset=a.offset + 4)))
    assert "overlaps" in _problems(Bucket(bad, bucket.data))


def test_out_of_range_entry(bucket: Bucket) -> None:
    a, b = bucket.manifest.entries
    bad = attrs.evolve(bucket.manifest, entries=(a, attrs.evolve(b, offset=b.offset + 8)))
    assert "run past" in _problems(Bucket(bad, bucket.data))


def test_misaligned_and_wrong_size_entries_are_all_listed(bucket: Bucket) -> None:
    a, b = bucket.manifest.entries
    bad = attrs.evolve(
        bucket.manifest, entries=(attrs.evolve(a, nbytes=a.nbytes - 1), attrs.evolve(b, offset=b.offset + 2))
    )
    with pytest.raises(WeightUpdateError) as info:
        verify(Bucket(bad, bucket.data))
    text = "\n".join(info.value.problems)
    assert "do not fit shape" in text
    assert "misaligned" in text
    assert len(info.value.problems) >= 2


def test_entry_dtype_mismatch_and_unknown_dtype(bucket: Bucket) -> None:
    a, b = bucket.manifest.entries
    bad = attrs.evolve(bucket.manifest, entries=(a, attrs.evolve(b, dtype="int32")))
    assert "differs from the bucket" in _problems(Bucket(bad, bucket.data))
    with pytest.raises(WeightUpdateError, match="unknown dtype"):
        verify(Bucket(attrs.evolve(bucket.manifest, dtype="float7"), bucket.data))


def test_checksum_can_be_skipped_but_structure_is_still_checked(bucket: Bucket) -> None:
    unchecked = Bucket(attrs.evolve(bucket.manifest, checksum=None), bucket.data.clone())
    unchecked.data[0] ^= 1
    verify(unchecked)  # no checksum to compare
    assert "truncated" in _problems(Bucket(unchecked.manifest, unchecked.data[:5]))


def test_bad_limit_rejected() -> None:
    with pytest.raises(ValueError):
        pack([("a", torch.ones(1))], max_bucket_bytes=0)
