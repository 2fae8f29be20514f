"""The facade's discard-weights release and delta weight sync (issue 14 items 3 and 6), around the
TEST-ONLY recording double, and the trainer-side helpers of rlinfer_core.delta."""

from __future__ import annotations

import pytest
import torch
from recording_double import RecordingObserver
from test_engine_facade import backend, double_entry_point, good_update, opened, run

from rlinfer_core.delta import DeltaTracker, changed_tensors, same_bits
from rlinfer_core.errors import InvalidRequest, UnsupportedCapability, WeightsNotLoaded, WeightUpdateError
from rlinfer_core.scoring import ScoreRequest
from rlinfer_core.types import BASE_MEMORY_TAGS, Capability, GenerateRequest
from rlinfer_core.weights import NamedTensors, WeightDelta

__all__ = ["double_entry_point"]

DISCARDING = [
    Capability.MEMORY_RELEASE.value,
    Capability.MEMORY_DISCARD_WEIGHTS.value,
    Capability.WEIGHTS_TENSORS.value,
    Capability.STREAM.value,
    Capability.PROMPT_LOGPROBS.value,
]
REQUEST = GenerateRequest(prompt_token_ids=[1, 2])


def test_discard_release_refuses_generation_until_a_full_update() -> None:
    async def body() -> None:
        engine = await opened(supported=DISCARDING)
        assert engine.capabilities.supports(Capability.WEIGHTS_DELTA)  # derived from weights.tensors
        assert await engine.update_weights(good_update(1.0)) == 1
        with pytest.raises(InvalidRequest) as bad:
            await engine.release_memory(["kv_cache"], discard_weights=True)
        assert bad.value.field == "discard_weights"
        await engine.release_memory(discard_weights=True)
        assert ("release_memory", (BASE_MEMORY_TAGS, True)) in backend().calls
        assert engine.weights_discarded and engine.released == BASE_MEMORY_TAGS
        with pytest.raises(WeightUpdateError, match="released"):
            await engine.update_weights(good_update(2.0))  # weights' memory not back yet
        await engine.resume_memory(["weights"])
        await engine.resume_memory(["kv_cache"])
        assert engine.released == frozenset()
        with pytest.raises(WeightsNotLoaded, match="full"):
            await engine.generate(REQUEST)
        with pytest.raises(WeightsNotLoaded):
            engine.stream(REQUEST)
        with pytest.raises(WeightsNotLoaded):
            await engine.score([ScoreRequest([1, 2], [3])])
        calls = len(backend().calls)
        with pytest.raises(WeightUpdateError, match="lacks 1 of the 2") as partial:
            await engine.update_weights({"w": torch.ones(2, 2)})
        assert partial.value.problems == ("b: missing",)
        with pytest.raises(WeightUpdateError, match="delta cannot be applied"):
            await engine.update_weights(WeightDelta(1, (("w", torch.ones(2, 2)),)))
        assert len(backend().calls) == calls and engine.weight_version == 1  # nothing reached the backend
        assert engine.weights_discarded
        assert await engine.update_weights(good_update(3.0)) == 2
        assert not engine.weights_discarded
        assert len(await engine.generate(REQUEST)) == 1
        await engine.shutdown()

    run(body())


def test_discard_needs_its_capability_and_unreleased_weights() -> None:
    async def body() -> None:
        engine = await opened(supported=[Capability.MEMORY_RELEASE.value, Capability.WEIGHTS_TENSORS.value])
        with pytest.raises(UnsupportedCapability) as info:
            await engine.release_memory(discard_weights=True)
        assert info.value.capability == "memory.discard_weights"
        assert "no memory to discard" in str(info.value)
        assert "release_memory" not in backend().names()
        await engine.shutdown()

        engine = await opened(supported=DISCARDING)
        await engine.release_memory(["weights"])  # with the host backup
        with pytest.raises(InvalidRequest, match="already released") as bad:
            await engine.release_memory(discard_weights=True)
        assert bad.value.field == "discard_weights" and not engine.weights_discarded
        await engine.resume_memory()
        assert len(await engine.generate(REQUEST)) == 1
        await engine.shutdown()

    run(body())


def test_delta_applies_only_on_its_base_version() -> None:
    async def body() -> None:
        observer = RecordingObserver()
        engine = await opened(observer, supported=DISCARDING)
        w = torch.full((2, 2), 5.0)
        assert await engine.update_weights(WeightDelta(0, [("w", w)])) == 1
        update = [arg for name, arg in backend().calls if name == "update_weights"][-1]
        assert isinstance(update.source, NamedTensors) and [n for n, _ in update.source.tensors] == ["w"]
        assert update.version == 1
        assert observer.of("weights_updated")[-1] == {"version": 1, "transport": "delta", "nbytes": 16}
        calls = len(backend().calls)
        with pytest.raises(WeightUpdateError, match="base_version 0") as stale:
            await engine.update_weights(WeightDelta(0, [("w", w)]))
        assert "weight_version 1" in str(stale.value)
        with pytest.raises(WeightUpdateError, match="shape"):
            await engine.update_weights(WeightDelta(1, [("w", torch.ones(3))]))
        with pytest.raises(WeightUpdateError, match="no tensors"):
            await engine.update_weights(WeightDelta(1, []))
        assert len(backend().calls) == calls and engine.weight_version == 1
        assert observer.of("weight_update_failed")[-1]["transport"] == "delta"
        assert await engine.update_weights(WeightDelta(1, [("b", torch.ones(2))]), version=7) == 7
        await engine.shutdown()

    run(body())


def test_delta_is_unsupported_without_named_tensors() -> None:
    async def body() -> None:
        engine = await opened(supported=[Capability.WEIGHTS_DISK.value])
        assert not engine.capabilities.supports(Capability.WEIGHTS_DELTA)
        assert "weights.tensors" in engine.capabilities.notes[Capability.WEIGHTS_DELTA.value]
        with pytest.raises(UnsupportedCapability) as info:
            await engine.update_weights(WeightDelta(0, [("w", torch.ones(2, 2))]))
        assert info.value.capability == "weights.delta"
        await engine.shutdown()

    run(body())


def test_weight_delta_validates_its_base_version() -> None:
    with pytest.raises(InvalidRequest):
        WeightDelta(-1, ())
    delta = WeightDelta.of(3, {"w": torch.ones(2, 2, dtype=torch.bfloat16)})
    assert delta.base_version == 3 and delta.nbytes == 8


def test_changed_tensors_compares_bits() -> None:
    before = {"a": torch.zeros(3), "b": torch.ones(2), "c": torch.tensor([float("nan")])}
    after = {"a": torch.tensor([0.0, -0.0, 0.0]), "b": torch.ones(2), "c": before["c"].clone(), "d": torch.ones(1)}
    assert [n for n, _ in changed_tensors(before, after)] == ["a", "d"]  # -0.0 differs in bits; NaN equals itself
    assert not same_bits(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not same_bits(torch.ones(2), torch.ones(1, 2))


def test_delta_tracker_sends_what_changed_since_the_last_commit() -> None:
    model = torch.nn.Linear(4, 3)
    tracker = DeltaTracker(model.named_parameters(), version=2)
    assert tracker.nbytes == (12 + 3) * 4
    assert tracker.delta(model.named_parameters()).tensors == ()
    with torch.no_grad():
        model.bias.add_(1.0)
    delta = tracker.delta(model.named_parameters())
    assert delta.base_version == 2 and [n for n, _ in delta.tensors] == ["bias"]
    tracker.commit(delta, 3)
    assert tracker.version == 3 and tracker.delta(model.named_parameters()).tensors == ()
    with torch.no_grad():
        model.bias.add_(1.0)  # the snapshot is a copy, not a view of the live tensor
    assert [n for n, _ in tracker.delta(dict(model.named_parameters())).tensors] == ["bias"]
    with pytest.raises(InvalidRequest, match="base_version 2"):
        tracker.commit(delta, 4)
    with pytest.raises(InvalidRequest, match="never saw"):
        tracker.delta({"other": torch.ones(1)})
    tracker.reset(model.named_parameters(), 9)
    assert tracker.version == 9 and tracker.delta(model.named_parameters()).tensors == ()
