"""Staged weight updates (``weights.staged``): stage while generating, commit, cancel, bounds.

``stage_weights`` moves the next weights into the engine while requests run on the old ones;
``commit`` makes them live (the version goes up once, the served model is the oracle's second
one); ``cancel`` leaves the old weights and version. Bad tensors are refused at stage time and
the staged bytes are bounded (``EngineConfig.max_staged_weight_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import pytest

from rlinfer_conformance.streaming import joined, stream_in_background
from rlinfer_conformance.world import BASE, LOGPROB_TOLERANCE, OP_TIMEOUT_S, OTHER, SMALL_BUCKET_BYTES, KitWorld
from rlinfer_core.errors import StagingLimitExceeded, WeightStagingError, WeightUpdateError
from rlinfer_core.staging import StagingState, WeightStaging
from rlinfer_core.types import Capability, FinishReason
from rlinfer_core.weights import Buckets, NamedTensors, WeightSource

__all__ = [
    "test_staged_update_commits_while_requests_run_on_the_old_weights",
    "test_staged_then_cancelled_keeps_the_old_weights",
    "test_staged_bad_tensors_are_refused_at_stage_time",
    "test_staged_in_buckets_within_the_bound",
]

HOOKS = ("rlinfer_stage_weights", "rlinfer_commit_staged_weights", "rlinfer_cancel_staged_weights")
#: tries for a request to be still in flight when staging returns (a loaded machine may finish it first)
IN_FLIGHT_TRIES = 5


def _commit(world: KitWorld, staging: WeightStaging, key: str) -> int:
    """Commit ``staging`` (model ``key``): the version goes up exactly once and ``key`` is served."""
    before = world.engine.weight_version
    seen = len(world.events.events)
    version = staging.commit()
    world.current = key
    assert version == staging.version == before + 1 == world.engine.weight_version
    assert staging.state is StagingState.COMMITTED
    updated = [e for n, e in world.events.events[seen:] if n == "rlinfer_on_weights_updated"]
    assert updated == [{"version": version, "transport": "staged"}]
    world.verify_served(key, "after a staged commit")
    return version


@pytest.mark.requires(Capability.WEIGHTS_STAGED, Capability.STREAM, Capability.WEIGHTS_TENSORS)
@pytest.mark.hooks(*HOOKS)
def test_staged_update_commits_while_requests_run_on_the_old_weights(rlinfer_base_weights: KitWorld) -> None:
    world = rlinfer_base_weights
    engine = world.engine
    old = engine.weight_version
    for _ in range(IN_FLIGHT_TRIES):
        request, first, future = stream_in_background(world, "staged")
        assert first.wait(OP_TIMEOUT_S), "the request produced no token"
        staging = engine.stage_weights(world.source(Capability.WEIGHTS_TENSORS, OTHER))
        in_flight = request.request_id in engine.in_flight  # staging did not wait for it to end
        completion = joined(request, future.result(timeout=OP_TIMEOUT_S))
        assert completion.finish_reason is FinishReason.LENGTH
        # staged, not live: every token of the request came from the old weights
        assert set(completion.token_versions or ()) == {old} and completion.weight_version == old
        parity = world.oracle.check_versions({old: BASE}, request, completion)
        assert not parity.argmax_mismatches, parity.argmax_mismatches[:5]
        assert parity.max_abs_logprob_delta <= LOGPROB_TOLERANCE, parity
        assert engine.weight_version == old and staging.staged_bytes > 0
        if in_flight:
            break
        staging.cancel()  # the request ended before staging returned: no premise; again
    else:
        pytest.fail(
            f"premise not reached in {IN_FLIGHT_TRIES} tries: the long request always ended before "
            "stage_weights returned, so staging was never seen to run beside generation"
        )
    new = _commit(world, staging, OTHER)
    completions = world.generate_and_check(f"after_staged_commit_v{new}")  # the second model now
    assert all(set(c.token_versions or ()) == {new} and c.weight_version == new for c in completions)


@pytest.mark.requires(Capability.WEIGHTS_STAGED, Capability.WEIGHTS_TENSORS)
@pytest.mark.hooks(*HOOKS)
def test_staged_then_cancelled_keeps_the_old_weights(rlinfer_base_weights: KitWorld) -> None:
    world = rlinfer_base_weights
    engine = world.engine
    version = engine.weight_version
    staging = engine.stage_weights(world.source(Capability.WEIGHTS_TENSORS, OTHER))
    with pytest.raises(WeightStagingError):  # one staging at a time, and no plain update meanwhile
        engine.stage_weights(world.source(Capability.WEIGHTS_TENSORS, OTHER))
    with pytest.raises(WeightStagingError):
        engine.update_weights(world.source(Capability.WEIGHTS_TENSORS, OTHER))
    staging.cancel()
    assert staging.state is StagingState.CANCELLED and engine.weight_version == version
    with pytest.raises(WeightStagingError):
        staging.commit()
    world.verify_served(BASE, "after a cancelled staging")
    world.generate_and_check("after_staged_cancel")  # still the base model (world.current)


@pytest.mark.requires(Capability.WEIGHTS_STAGED, Capability.WEIGHTS_TENSORS)
@pytest.mark.hooks(*HOOKS)
def test_staged_bad_tensors_are_refused_at_stage_time(rlinfer_base_weights: KitWorld) -> None:
    import torch

    world = rlinfer_base_weights
    engine = world.engine
    version = engine.weight_version
    name, tensor = world.oracle.named_parameters(OTHER)[0]
    nan = tensor.clone()
    nan.view(-1)[0] = float("nan")
    for bad in ({name: torch.zeros(3, 5, dtype=tensor.dtype)}, {name: nan}, {"no.such.weight": tensor}):
        with pytest.raises(WeightUpdateError):
            engine.stage_weights(NamedTensors.of(bad))
    staging = engine.stage_weights(NamedTensors.of({name: tensor}))  # nothing was left open
    with pytest.raises(WeightUpdateError):
        staging.add(NamedTensors.of({name: tensor}))  # a name staged twice
    assert staging.state is StagingState.OPEN
    staging.cancel()
    assert engine.weight_version == version
    world.generate_and_check(None, max_tokens=4)  # the old weights, unchanged


@contextmanager
def _bound(world: KitWorld, limit: int | None) -> Iterator[None]:
    """``EngineConfig.max_staged_weight_bytes`` set to ``limit`` (read at every stage call)."""
    config = world.engine.config
    world.engine.config = attrs.evolve(config, max_staged_weight_bytes=limit)
    try:
        yield
    finally:
        world.engine.config = config


def _part(world: KitWorld, tensors: list[tuple[str, Any]]) -> WeightSource:
    """Buckets where claimed (bucketed staging mixes transports), else named tensors."""
    if world.supports(Capability.WEIGHTS_BUCKETS):
        from rlinfer_core.transfer.buckets import pack

        return Buckets(pack(tensors, max_bucket_bytes=SMALL_BUCKET_BYTES))
    return NamedTensors.of(tensors)


@pytest.mark.requires(Capability.WEIGHTS_STAGED, Capability.WEIGHTS_TENSORS)
@pytest.mark.hooks(*HOOKS)
def test_staged_in_buckets_within_the_bound(rlinfer_base_weights: KitWorld) -> None:
    world = rlinfer_base_weights
    engine = world.engine
    tensors = world.oracle.named_parameters(OTHER)
    half = len(tensors) // 2
    first, rest = tensors[:half], tensors[half:]
    first_bytes = sum(t.numel() * t.element_size() for _, t in first)
    with _bound(world, first_bytes):
        staging = engine.stage_weights(NamedTensors.of(first))
        assert staging.staged_bytes == first_bytes
        try:
            with pytest.raises(StagingLimitExceeded):
                staging.add(_part(world, rest))
            assert staging.staged_bytes == first_bytes and staging.state is StagingState.OPEN
        except BaseException:
            staging.cancel()
            raise
    assert engine.staged_weight_limit >= sum(t.numel() * t.element_size() for _, t in tensors)  # one full copy
    try:
        staging.add(_part(world, rest))
    except BaseException:
        staging.cancel()
        raise
    new = _commit(world, staging, OTHER)
    world.generate_and_check(f"after_bucketed_staged_commit_v{new}")
