"""The value check on packed buckets (rlinfer_core.transfer.validate.packed_nonfinite_problems),
on CPU tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rlinfer_core.transfer.buckets import pack, unpack_all  # noqa: E402
from rlinfer_core.transfer.validate import packed_nonfinite_problems  # noqa: E402


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_packed_value_check_names_the_offender(bad: float) -> None:
    tensors = [(f"w{i}", torch.randn(8, 8).to(torch.bfloat16)) for i in range(5)]
    tensors.append(("ids", torch.arange(4)))
    buckets = pack(tensors, 256)
    assert len(buckets) > 2 and packed_nonfinite_problems(buckets, tensors) == []
    tensors[3][1][2, 5] = bad
    buckets = pack(tensors, 256)
    assert packed_nonfinite_problems(buckets, tensors) == ["w3: holds NaN or inf values"]
    assert [n for n, _ in unpack_all(buckets)] == [n for n, _ in tensors]


def test_packed_value_check_clears_a_sum_that_only_overflowed() -> None:
    big = torch.full((4,), 3e38, dtype=torch.float32)
    tensors = [("a", big), ("b", big.clone())]
    assert packed_nonfinite_problems(pack(tensors, 1 << 20), tensors) == []


def test_pack_and_unpack_keep_any_layout() -> None:
    tensors = [
        ("a", torch.randn(4, 6).to(torch.bfloat16)),
        ("odd", torch.randn(3).to(torch.bfloat16)),  # 6 bytes: the next one starts mid-word
        ("t", torch.randn(5, 4).to(torch.bfloat16).t()),  # not contiguous
        ("empty", torch.zeros(0, 3, dtype=torch.bfloat16)),
        ("ids", torch.arange(5)),
    ]
    got = dict(unpack_all(pack(tensors, 1 << 20)))
    for name, t in tensors:
        assert got[name].shape == t.shape and torch.equal(got[name], t), name
