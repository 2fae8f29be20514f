"""Staged weight updates (capability weights.staged, rlinfer_core.staging): the handle's states,
validation at stage time, the bound, and the facade's bookkeeping, around the TEST-ONLY recording
double (tests/core/recording_double.py: it records the staging hooks and holds what is staged)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from recording_double import DEFAULT_SUPPORTED, RecordingObserver
from test_engine_facade import backend, double_entry_point, good_update, run
from test_sync_surface import twin_problems

from rlinfer_core.engine import AsyncEngine
from rlinfer_core.errors import (
    InvalidRequest,
    StagingLimitExceeded,
    UnsupportedCapability,
    WeightStagingError,
    WeightUpdateError,
)
from rlinfer_core.staging import AsyncWeightStaging, StagingState, WeightStaging
from rlinfer_core.sync_engine import Engine
from rlinfer_core.types import Capability, EngineConfig, GenerateRequest
from rlinfer_core.weights import BroadcastSource, NamedTensors, TensorSpec, WeightUpdate

__all__ = ["double_entry_point"]

FULL_BYTES = 4 * 4 + 2 * 4  # the double's w (2x2) and b (2), float32
REQUEST = GenerateRequest(prompt_token_ids=[1, 2])


async def opened(observer: RecordingObserver | None = None, **fields: Any) -> AsyncEngine:
    engine_kwargs = {k: fields.pop(k) for k in ("supported", "fail_update", "fail_stage") if k in fields}
    config = EngineConfig(model="m", request_timeout_s=5.0, engine_kwargs=engine_kwargs, **fields)
    return await AsyncEngine.open("double", config, plugins=[observer] if observer else [])


def staging_calls() -> list[str]:
    return [n for n in backend().names() if "staged" in n or n.startswith("stage")]


def test_stage_then_commit_bumps_the_version_once() -> None:
    async def body() -> None:
        observer = RecordingObserver()
        engine = await opened(observer)
        staging = await engine.stage_weights(good_update(2.0))
        assert (staging.state, staging.version, staging.staged_bytes) == (StagingState.OPEN, 1, FULL_BYTES)
        assert staging.names == {"w", "b"}
        assert engine.weight_version == 0  # nothing live yet
        assert len(await engine.generate(REQUEST)) == 1  # still serving
        assert staging_calls() == ["stage_weights"] and list(backend().staged) == [staging.staging_id]
        assert await staging.commit() == 1 == engine.weight_version
        assert staging.state is StagingState.COMMITTED and backend().staged == {}
        assert staging_calls() == ["stage_weights", "commit_staged_weights"]
        assert backend().calls[-1] == ("reset_prefix_cache", None)  # as after update_weights
        updated = observer.of("weights_updated")
        assert [(e["version"], e["transport"], e["nbytes"]) for e in updated] == [(1, "staged", FULL_BYTES)]
        with pytest.raises(WeightStagingError, match="committed"):
            await staging.commit()
        await staging.cancel()  # nothing to do once committed
        assert staging_calls()[-1] == "commit_staged_weights"
        assert await engine.update_weights(good_update(3.0)) == 2  # the engine takes plain updates again
        await engine.shutdown()

    run(body())


def test_buckets_are_staged_into_one_handle_and_committed_as_one_update() -> None:
    async def body() -> None:
        engine = await opened()
        staging = await engine.stage_weights({"w": torch.ones(2, 2)}, version=4)
        assert await staging.add({"b": torch.zeros(2)}) == FULL_BYTES == staging.staged_bytes
        with pytest.raises(WeightStagingError, match="staged already") as twice:
            await staging.add({"w": torch.ones(2, 2)})
        assert twice.value.problems == ("w: staged twice",)
        with pytest.raises(InvalidRequest, match="makes version 4"):
            await staging.add(WeightUpdate(NamedTensors.of({"b": torch.zeros(2)}), version=7))
        assert staging.state is StagingState.OPEN and staging.staged_bytes == FULL_BYTES
        assert len(backend().staged[staging.staging_id]) == 2  # the refused parts never reached it
        assert await staging.commit() == 4 == engine.weight_version
        assert staging_calls() == ["stage_weights", "stage_weights", "commit_staged_weights"]
        await engine.shutdown()

    run(body())


def test_cancel_keeps_the_old_weights_and_version() -> None:
    async def body() -> None:
        engine = await opened()
        assert await engine.update_weights(good_update(1.0)) == 1
        async with await engine.stage_weights(good_update(5.0)) as staging:
            assert staging.version == 2
        assert staging.state is StagingState.CANCELLED and backend().staged == {}
        assert engine.weight_version == 1
        assert staging_calls() == ["stage_weights", "cancel_staged_weights"]
        await staging.cancel()  # twice: nothing more
        with pytest.raises(WeightStagingError, match="cancelled"):
            await staging.add({"b": torch.zeros(2)})
        staged = await engine.stage_weights(good_update(6.0))  # a new staging may open now
        assert staged.version == 2
        await staged.cancel()
        await engine.shutdown()

    run(body())


def test_bad_tensors_are_refused_at_stage_time_and_nothing_is_staged() -> None:
    async def body() -> None:
        engine = await opened()
        for bad, problem in (
            ({"w": torch.ones(3, 2)}, "shape"),
            ({"w": torch.full((2, 2), float("nan"))}, "NaN"),
            ({"nope": torch.ones(2)}, "unknown"),
        ):
            with pytest.raises(WeightUpdateError) as info:
                await engine.stage_weights(bad)
            assert problem in str(info.value)
        assert staging_calls() == [] and engine.weight_version == 0
        staging = await engine.stage_weights({"w": torch.ones(2, 2)})
        with pytest.raises(WeightUpdateError, match="shape"):
            await staging.add({"b": torch.ones(3)})
        assert staging.state is StagingState.OPEN and staging.names == {"w"}  # a refused add leaves it
        broadcast = BroadcastSource((TensorSpec("b", "float32", (2,)),))
        with pytest.raises(InvalidRequest, match="not a broadcast"):
            await staging.add(broadcast)
        await staging.cancel()
        await engine.shutdown()

    run(body())


def test_one_staging_at_a_time_and_no_plain_update_meanwhile() -> None:
    async def body() -> None:
        engine = await opened()
        staging = await engine.stage_weights(good_update(2.0))
        with pytest.raises(WeightStagingError, match="is open"):
            await engine.stage_weights(good_update(3.0))
        with pytest.raises(WeightStagingError, match="before update_weights"):
            await engine.update_weights(good_update(3.0))
        assert "update_weights" not in backend().names() and engine.weight_version == 0
        with pytest.raises(WeightUpdateError, match="must be greater"):
            await (await opened()).stage_weights(good_update(1.0), version=0)
        assert await staging.commit() == 1
        await engine.shutdown()

    run(body())


def test_the_bound_on_staged_bytes() -> None:
    async def body() -> None:
        engine = await opened()
        assert engine.staged_weight_limit == FULL_BYTES  # default: one full copy of the weights
        await engine.shutdown()
        engine = await opened(max_staged_weight_bytes=20)
        assert engine.staged_weight_limit == 20
        staging = await engine.stage_weights({"w": torch.ones(2, 2)})  # 16 bytes
        with pytest.raises(StagingLimitExceeded) as info:
            await staging.add({"b": torch.zeros(2)})  # 8 more
        assert (info.value.staged_bytes, info.value.requested, info.value.limit) == (16, 8, 20)
        assert isinstance(info.value, WeightStagingError)
        assert staging.state is StagingState.OPEN and staging.staged_bytes == 16
        assert await staging.commit() == 1  # a partial update, as update_weights takes one
        with pytest.raises(StagingLimitExceeded):
            await engine.stage_weights(good_update(1.0))  # 24 > 20 from the start
        assert engine._staging.open is None
        await engine.shutdown()

    run(body())


def test_the_config_is_read_at_every_call() -> None:
    """A caller may replace ``engine.config`` while the engine runs (the kit bounds one test's
    staging this way): the bound is the config's now, not the one at open."""

    async def body() -> None:
        engine = await opened()
        engine.config = attrs.evolve(engine.config, max_staged_weight_bytes=20)
        assert engine.staged_weight_limit == 20
        with pytest.raises(StagingLimitExceeded):
            await engine.stage_weights(good_update(1.0))  # 24 > 20
        await engine.shutdown()

    run(body())


def test_unsupported_without_the_capability() -> None:
    async def body() -> None:
        supported = [c.value for c in DEFAULT_SUPPORTED if c is not Capability.WEIGHTS_STAGED]
        engine = await opened(supported=supported)
        with pytest.raises(UnsupportedCapability) as info:
            await engine.stage_weights(good_update(1.0))
        assert info.value.capability == "weights.staged"
        assert staging_calls() == []
        await engine.shutdown()

    run(body())


def test_a_failure_inside_the_engine_ends_the_staging() -> None:
    async def body() -> None:
        engine = await opened(fail_stage=True)
        with pytest.raises(WeightUpdateError, match="failed to stage"):
            await engine.stage_weights(good_update(1.0))
        assert staging_calls() == ["stage_weights", "cancel_staged_weights"]  # nothing left behind
        assert engine._staging.open is None
        await engine.shutdown()

        engine = await opened(fail_update=True)
        staging = await engine.stage_weights(good_update(1.0))
        with pytest.raises(WeightUpdateError, match="failed to load"):
            await staging.commit()
        assert staging.state is StagingState.CANCELLED and engine.weight_version == 0
        assert staging_calls() == ["stage_weights", "commit_staged_weights", "cancel_staged_weights"]
        assert engine._staging.open is None
        await engine.shutdown()

    run(body())


def test_the_blocking_handle() -> None:
    assert twin_problems(AsyncWeightStaging, WeightStaging) == []
    engine = Engine.open("double", EngineConfig(model="m", request_timeout_s=5.0))
    try:
        staging = engine.stage_weights({"w": torch.ones(2, 2)})
        assert isinstance(staging, WeightStaging) and staging.add({"b": torch.zeros(2)}) == FULL_BYTES
        assert staging.commit() == 1 == engine.weight_version
        with engine.stage_weights(good_update(2.0)) as second:
            assert second.version == 2
        assert second.state is StagingState.CANCELLED and engine.weight_version == 1
    finally:
        engine.shutdown()
