"""Batched byte copies (rlinfer_core.transfer.copies) and the value check on packed buckets
(rlinfer_core.transfer.validate.packed_nonfinite_problems), on CPU tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rlinfer_core.transfer.buckets import pack, unpack_all  # noqa: E402
from rlinfer_core.transfer.copies import as_words, copy_all  # noqa: E402
from rlinfer_core.transfer.validate import packed_nonfinite_problems  # noqa: E402


def test_as_words_views_whole_words_only() -> None:
    t = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    words = as_words(t)
    assert words is not None and words.dtype == torch.int64 and words.numel() == 2
    assert words.data_ptr() == t.data_ptr(), "a view, not a copy"
    assert as_words(torch.zeros(3, dtype=torch.bfloat16)) is None, "6 bytes is not a whole word"
    assert as_words(t.t()) is None, "not contiguous"
    assert as_words(torch.zeros(10, dtype=torch.bfloat16)[1:5]) is None, "starts mid-word"


def test_copy_all_copies_every_pair_whatever_its_layout() -> None:
    srcs = [
        torch.randn(4, 6).to(torch.bfloat16),  # whole words
        torch.randn(3).to(torch.bfloat16),  # 6 bytes: not a whole word
        torch.randn(5, 4).t(),  # not contiguous
        torch.randint(0, 9, (0,)),  # empty
    ]
    dests = [torch.empty_like(s) for s in srcs]
    copy_all(dests, srcs)
    for d, s in zip(dests, srcs, strict=True):
        assert torch.equal(d, s)


def test_copy_all_fills_byte_slots_of_a_buffer() -> None:
    srcs = [torch.randn(4, 4), torch.randn(3).to(torch.bfloat16), torch.randn(2, 2).t()]
    sizes = [s.numel() * s.element_size() for s in srcs]
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8)
    slots = list(torch.split(buffer, sizes))
    copy_all(slots, srcs)
    for slot, s in zip(slots, srcs, strict=True):
        assert torch.equal(slot.clone().view(s.dtype).reshape(s.shape), s)
    with pytest.raises(ValueError):
        copy_all([torch.zeros(8, dtype=torch.uint8)], [torch.zeros(4, dtype=torch.float32)])


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
