"""The two digest algorithms of weights.checksum and how verify picks the engine's."""

from __future__ import annotations

import pytest
import torch

from rlinfer_core.checksum import digest_algorithm, tensor_checksum, verify


@pytest.mark.parametrize("algorithm", ["b2", "fp"])
def test_any_one_word_changed_is_caught(algorithm: str) -> None:
    t = torch.randn(300, 77)
    served = {"w": tensor_checksum(t, algorithm=algorithm)}
    assert digest_algorithm(served["w"]) == algorithm
    assert verify(served, [("w", t.clone())]).ok
    for index in (0, 4321, t.numel() - 1):
        for delta in (1, -1, 2**31 - 1, 2**31 - 19):  # multiples of either modulus alone
            changed = t.clone().reshape(-1)
            changed.view(torch.int32)[index] += delta
            assert verify(served, [("w", changed.view(300, 77))]).mismatched == ("w",), (index, delta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_fingerprint_of_every_width_and_odd_sizes(dtype: torch.dtype) -> None:
    t = (torch.arange(7) % 2).to(dtype) if dtype == torch.bool else torch.arange(7).to(dtype)
    a, b = tensor_checksum(t, algorithm="fp"), tensor_checksum(t.clone(), algorithm="fp")
    assert a == b
    other = t.clone()
    other[3] = other[2] if dtype != torch.bool else ~other[3]
    assert tensor_checksum(other, algorithm="fp") != a


def test_added_is_applied_to_the_trainer_side_in_the_served_dtype() -> None:
    w = torch.randn(64) * 0.1
    served = {"norm.weight": tensor_checksum(w + 1.0)}
    assert not verify(served, [("norm.weight", w)]).ok
    served = {"norm.weight": tensor_checksum(w + 1.0, added=0.0)}
    served["norm.weight"] = type(served["norm.weight"])(
        served["norm.weight"].dtype, served["norm.weight"].shape, served["norm.weight"].digest, 1.0
    )
    assert verify(served, [("norm.weight", w)]).ok


def test_fingerprint_over_several_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinfer_core import checksum

    monkeypatch.setattr(checksum, "_SLAB", 1 << 15)
    monkeypatch.setattr(checksum, "_WEIGHTS", {})
    t = torch.randn(100_003)  # four slabs, the last one padded
    served = {"w": tensor_checksum(t, algorithm="fp")}
    assert verify(served, [("w", t.clone())]).ok
    for index in (5, (1 << 15) + 7, 3 * (1 << 15) + 11):
        changed = t.clone()
        changed.view(torch.int32)[index] += 2**31 - 1
        assert not verify(served, [("w", changed)]).ok, index
    moved = t.clone()
    moved[[0, 1 << 15]] = moved[[1 << 15, 0]]  # the same words in other slabs
    assert not verify(served, [("w", moved)]).ok
