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


def test_fingerprints_in_passes_over_many_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinfer_core import checksum

    monkeypatch.setattr(checksum, "_GROUP_ROWS", 4)  # a long tensor spans passes; short ones share one
    tensors = {"long": torch.randn(100_003), "a": torch.randn(7), "b": torch.randn(3, 5), "c": torch.randn(4097)}
    served = dict(
        zip(tensors, checksum.tensor_checksums([(t, None, 0.0, "fp") for t in tensors.values()]), strict=True)
    )
    assert served == {n: tensor_checksum(t, algorithm="fp") for n, t in tensors.items()}  # batching changes nothing
    assert verify(served, [(n, t.clone()) for n, t in tensors.items()]).ok
    for index in (5, 4096 * 9 + 7, 100_002):  # rows of different passes, and the padded last row
        changed = tensors["long"].clone()
        changed.view(torch.int32)[index] += 2**31 - 1
        result = verify(served, [*((n, t) for n, t in tensors.items() if n != "long"), ("long", changed)])
        assert result.mismatched == ("long",), index
    moved = tensors["long"].clone()
    moved[[0, 4096]] = moved[[4096, 0]]  # the same words in other rows
    assert not verify(served, [("long", moved)]).ok


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: run on the device (docs/gpu.md)")
def test_host_tensors_are_fingerprinted_on_the_gpu_with_the_same_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinfer_core import checksum

    monkeypatch.setattr(checksum, "_GROUP_ROWS", 4)  # host runs cross to the GPU in several passes
    tensors = [torch.randn(100_003), torch.randn(3, 5).to(torch.bfloat16), torch.arange(7).to(torch.int64)]
    on_gpu = checksum.tensor_checksums([(t.cuda(), None, 0.0, "fp") for t in tensors])
    passes_on: list[torch.device] = []
    fingerprints = checksum._fingerprints

    def recorded(runs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        passes_on.append(device)
        return fingerprints(runs, device)

    monkeypatch.setattr(checksum, "_fingerprints", recorded)
    assert checksum.tensor_checksums([(t, None, 0.0, "fp") for t in tensors]) == on_gpu
    assert [device.type for device in passes_on] == ["cuda"]
