"""What the facade does with the config's request limits, load_format="dummy" and the engine's
world size, around the TEST-ONLY double backend (recording_double.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from test_engine_facade import double_entry_point

from rlinfer_core import parallel
from rlinfer_core.engine import AsyncEngine
from rlinfer_core.errors import InvalidRequest, UnsupportedCapability, WeightsNotLoaded, WeightUpdateError
from rlinfer_core.types import EngineConfig, GenerateRequest, SamplingParams

__all__ = ["double_entry_point"]  # the module-scoped autouse fixture that installs the double


def opened(**fields: Any) -> AsyncEngine:
    return asyncio.run(AsyncEngine.open("double", EngineConfig(model="m", request_timeout_s=5.0, **fields)))


def request(prompt: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=list(range(1, prompt + 1)), sampling=SamplingParams(max_tokens=max_tokens))


def test_response_and_prompt_limits() -> None:
    engine = opened(max_prompt_tokens=4, max_response_tokens=3)
    done = asyncio.run(engine.generate([request(4, 3)]))
    assert len(done[0].token_ids) == 3
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(engine.generate([request(4, 4)]))
    assert info.value.field == "max_tokens" and "max_response_tokens (3)" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(engine.generate([request(5, 3)]))
    assert info.value.field == "prompt_token_ids" and "max_prompt_tokens (4)" in str(info.value)
    assert len(asyncio.run(opened().generate([request(5, 4)]))[0].token_ids) == 4, "no limits by default"


def test_dummy_weights_refuse_generation_until_a_full_update() -> None:
    engine = opened(load_format="dummy")
    assert engine.weights_discarded
    with pytest.raises(WeightsNotLoaded, match="load_format='dummy'"):
        asyncio.run(engine.generate([request(2, 2)]))
    with pytest.raises(WeightUpdateError, match="lacks 1 of the 2"):
        asyncio.run(engine.update_weights({"w": torch.ones(2, 2)}))
    asyncio.run(engine.update_weights({"w": torch.ones(2, 2), "b": torch.zeros(2)}))
    assert not engine.weights_discarded and asyncio.run(engine.generate([request(2, 2)]))
    assert not opened().weights_discarded


def test_broadcast_ranks_are_the_engines_world_size() -> None:
    assert opened().broadcast_ranks == 1
    config = EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=3, expert_parallel_size=6)
    assert config.world_size == 6
    engine = asyncio.run(AsyncEngine.open("double", config))
    assert engine.broadcast_ranks == 6


def test_parallel_refusal_names_the_feature() -> None:
    config = EngineConfig(model="m", tensor_parallel_size=2, expert_parallel_size=2, pipeline_parallel_size=2)
    assert parallel.requested(config) == [parallel.EXPERT, parallel.PIPELINE]
    parallel.refuse_unsupported(config, "double", {parallel.DATA: "no"})  # not asked for: no error
    with pytest.raises(UnsupportedCapability) as info:
        parallel.refuse_unsupported(config, "double", {parallel.PIPELINE: "stages are not built"})
    assert (info.value.capability, info.value.reason) == (parallel.PIPELINE, "stages are not built")
    with pytest.raises(InvalidRequest) as bad:
        EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2)
    assert bad.value.field == "expert_parallel_size" and "= 4" in str(bad.value)
