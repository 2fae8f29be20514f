"""The engine-agnostic part of fast in-place weight loading (rlinfer_core.transfer.fast_load): byte
overlaps, the per-model cache, and FastLoader's all-or-nothing batched copy over a plan given by
hand (the engines' plans: tests/backends/vllm/test_fast_load.py, tests/backends/sglang/test_sglang_fast_load.py)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rlinfer_core.transfer.fast_load import FastLoader, PerModel, SlicePlan, drop_overlaps  # noqa: E402


def test_drop_overlaps_removes_every_name_sharing_bytes() -> None:
    base = torch.zeros(20, 2)
    other = torch.zeros(4, 2)
    views = {"a": base[0:10], "b": base[2:4], "c": base[8:12], "d": base[12:20], "e": other[0:4], "f": base[0:0]}
    kept = drop_overlaps(views)
    assert set(kept) == {"d", "e", "f"}


class TwoParams(torch.nn.Module):
    """A model double: one 2-D weight (rows 0..3 of 6 are 'a', 4..5 padding) and one vector 'b'."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((6, 2), 9.0), requires_grad=False)
        self.v = torch.nn.Parameter(torch.zeros(3), requires_grad=False)


def plan_of(model: Any) -> SlicePlan:
    return SlicePlan({"a": model.w[:4], "b": model.v}, frozenset({"head"}), {"a": model.w[4:]})


def test_per_model_rebuilds_when_parameter_memory_is_replaced() -> None:
    model = TwoParams()
    builds: list[Any] = []
    cache = PerModel(lambda: model, lambda m: builds.append(m) or len(builds))
    assert cache.get() == 1 and cache.plan_s > 0
    assert cache.get() == 1 and cache.plan_s == 0.0
    model.v.data = torch.zeros(3)  # new memory: views taken before would write into nothing served
    assert cache.get() == 2
    cache.invalidate()
    assert cache.get() == 3


def test_load_copies_into_the_slices_and_zeroes_the_padding() -> None:
    model = TwoParams()
    loader = FastLoader(lambda: model, plan_of)
    a, b = torch.arange(8.0).reshape(4, 2), torch.tensor([1.0, 2.0, 3.0])
    assert loader.load([("a", a), ("head", torch.ones(7)), ("b", b)])
    assert torch.equal(model.w[:4], a) and torch.equal(model.v, b)
    assert torch.count_nonzero(model.w[4:]) == 0  # what the engine's vocabulary loader does


def test_padding_is_left_alone_when_its_name_is_not_in_the_update() -> None:
    model = TwoParams()
    loader = FastLoader(lambda: model, plan_of)
    assert loader.load([("b", torch.ones(3))])
    assert torch.equal(model.w, torch.full((6, 2), 9.0))


@pytest.mark.parametrize(
    "bad",
    [("unknown", torch.ones(3)), ("b", torch.ones(4)), ("b", torch.ones(3, dtype=torch.float64))],
    ids=["unknown", "shape", "dtype"],
)
def test_one_tensor_without_a_slice_means_nothing_written(bad: tuple[str, Any]) -> None:
    model = TwoParams()
    loader = FastLoader(lambda: model, plan_of)
    assert not loader.load([("a", torch.ones(4, 2)), bad])
    assert torch.equal(model.w, torch.full((6, 2), 9.0)) and torch.count_nonzero(model.v) == 0


def test_a_plan_that_cannot_be_built_means_load_weights(caplog: pytest.LogCaptureFixture) -> None:
    def broken(model: Any) -> SlicePlan:
        raise RuntimeError("unexpected module layout")

    model = TwoParams()
    loader = FastLoader(lambda: model, broken)
    assert not loader.load([("b", torch.ones(3))])
    assert torch.count_nonzero(model.v) == 0
    assert "no plan" in caplog.text
