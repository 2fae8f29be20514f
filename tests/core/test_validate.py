"""Weight-update validation reports every problem at once, for every source kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.transfer.buckets import pack
from rlinfer_core.transfer.disk import save_dir
from rlinfer_core.transfer.validate import check_tensors, nonfinite_problems, validate_source
from rlinfer_core.weights import BroadcastSource, Buckets, CheckpointDir, NamedTensors, TensorSpec

EXPECTED = {
    "model.embed.weight": TensorSpec("model.embed.weight", "float32", (4, 3)),
    "model.layers.0.mlp.weight": TensorSpec("model.layers.0.mlp.weight", "float32", (3, 3)),
    "model.norm.weight": TensorSpec("model.norm.weight", "bfloat16", (3,)),
}


def good() -> list[tuple[str, torch.Tensor]]:
    return [
        ("model.embed.weight", torch.randn(4, 3)),
        ("model.layers.0.mlp.weight", torch.randn(3, 3)),
        ("model.norm.weight", torch.ones(3, dtype=torch.bfloat16)),
    ]


def problems_of(tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    with pytest.raises(WeightUpdateError) as info:
        check_tensors(tensors, EXPECTED)
    assert "previous weights" in str(info.value)
    return info.value.problems


def test_valid_update_passes_and_counts_bytes() -> None:
    assert check_tensors(good(), EXPECTED) == 4 * 3 * 4 + 3 * 3 * 4 + 3 * 2
    # a partial update is fine
    assert check_tensors(good()[:1], EXPECTED) == 48


def test_every_problem_is_listed_in_one_error() -> None:
    tensors = [
        ("model.embed.weight", torch.randn(4, 4)),  # wrong shape
        ("model.norm.weight", torch.ones(3)),  # wrong dtype
        ("model.layers.0.mlp.weigth", torch.randn(3, 3)),  # unknown (typo)
        ("model.layers.9.mlp.weight", torch.randn(3, 3)),  # unknown, similar name exists
        ("model.embed.weight", torch.randn(4, 3)),  # duplicate
        ("model.layers.0.mlp.weight", torch.full((3, 3), float("nan"))),  # NaN
    ]
    problems = problems_of(tensors)
    text = "\n".join(problems)
    assert "model.embed.weight: shape (4, 4) != expected (4, 3)" in text
    assert "model.norm.weight: dtype float32 != expected bfloat16" in text
    assert "model.layers.0.mlp.weigth: unknown parameter name" in text
    assert "model.layers.9.mlp.weight: unknown parameter name (similar: " in text
    assert "model.embed.weight: duplicate name" in text
    assert "model.layers.0.mlp.weight: holds NaN or inf" in text
    assert len(problems) == 6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_values_rejected(bad: float) -> None:
    tensors = good()
    tensors[0][1][1, 2] = bad
    tensors[2][1][0] = bad
    problems = problems_of(tensors)
    assert problems == (
        "model.embed.weight: holds NaN or inf values",
        "model.norm.weight: holds NaN or inf values",
    )


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.integers(0, 40), st.sampled_from([None, "nan", "inf", "-inf"])),
        min_size=1,
        max_size=12,
    )
)
def test_fused_finiteness_check_names_exactly_the_bad_tensors(specs: list[tuple[torch.dtype, int, str | None]]) -> None:
    tensors, bad = [], []
    for i, (dtype, numel, poison) in enumerate(specs):
        t = torch.randn(numel).to(dtype) if dtype.is_floating_point else torch.arange(numel, dtype=dtype)
        if poison and numel and dtype.is_floating_point:
            t[numel // 2] = float(poison)
            bad.append(f"t{i}: holds NaN or inf values")
        tensors.append((f"t{i}", t))
    assert nonfinite_problems(tensors) == bad


def test_large_finite_values_whose_norm_overflows_are_accepted() -> None:
    # the fused pass sums |x| in float32 (overflows here); the per-tensor pass clears it
    big = [("a", torch.full((1000,), 3e38)), ("b", torch.full((8,), 6e4, dtype=torch.float16))]
    assert nonfinite_problems(big) == []


def test_empty_update_rejected() -> None:
    assert problems_of([]) == ("the update holds no tensors",)


def test_every_source_kind_is_validated(tmp_path: Path) -> None:
    bad = [("model.embed.weight", torch.randn(2, 3)), ("extra", torch.ones(1))]
    sources = [
        NamedTensors.of(bad),
        Buckets(pack(bad)),
        CheckpointDir(str(save_dir(bad, tmp_path / "ckpt"))),
        BroadcastSource((TensorSpec("model.embed.weight", "float32", (2, 3)), TensorSpec("extra", "float32", (1,)))),
    ]
    for source in sources:
        with pytest.raises(WeightUpdateError) as info:
            validate_source(source, EXPECTED)
        text = "\n".join(info.value.problems)
        assert "shape (2, 3) != expected (4, 3)" in text, source
        assert "extra: unknown parameter name" in text, source


def test_valid_sources_report_their_size(tmp_path: Path) -> None:
    tensors = good()
    size = 4 * 3 * 4 + 3 * 3 * 4 + 3 * 2
    assert validate_source(NamedTensors.of(tensors), EXPECTED) == size
    assert validate_source(Buckets(pack(tensors, max_bucket_bytes=16)), EXPECTED) == size
    assert validate_source(CheckpointDir(str(save_dir(tensors, tmp_path / "c"))), EXPECTED) == size
    assert validate_source(BroadcastSource(tuple(EXPECTED.values())), EXPECTED) == size


def test_corrupt_bucket_is_rejected_before_anything_else() -> None:
    buckets = pack(good())
    buckets[0].data[0] ^= 0xFF
    with pytest.raises(WeightUpdateError, match="corrupt bucket"):
        validate_source(Buckets(buckets), EXPECTED)


def test_checkpoint_data_is_checked_where_it_is_read(tmp_path: Path) -> None:
    from rlinfer_core.transfer.disk import read_checked

    tensors = good()
    poisoned = [(n, t.clone()) for n, t in tensors]
    poisoned[0][1].view(-1)[1] = float("nan")
    bad_dir = save_dir(poisoned, tmp_path / "bad")
    # the facade reads the headers only: names, shapes and dtypes are right, so it passes ...
    assert validate_source(CheckpointDir(str(bad_dir)), EXPECTED) > 0
    # ... and the engine side refuses the data before loading any of it
    with pytest.raises(WeightUpdateError) as info:
        read_checked(bad_dir)
    assert info.value.problems == (f"{poisoned[0][0]}: holds NaN or inf values",)
    assert [n for n, _ in read_checked(save_dir(tensors, tmp_path / "ok"))] == sorted(n for n, _ in tensors)
