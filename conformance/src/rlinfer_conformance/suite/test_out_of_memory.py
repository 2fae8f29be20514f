"""Out of memory on a tiny KV budget: a request that cannot fit the engine's KV cache raises
EngineOutOfMemory before anything runs, and the engine keeps serving with nothing lost; a batch
larger than the cache in total (each request fitting) is served, the engine queueing, preempting
or retracting as it must, at oracle parity.

The budget is absolute (``kv_cache_memory_bytes``), so these engines start the same whatever
else runs on the machine. An engine that cannot start with a KV cache smaller than one
``max_model_len`` request says so with UnsupportedCapability (vLLM), and the first test is
skipped with that reason: such an engine never meets a single request that cannot fit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.report import KitReport
from rlinfer_conformance.world import KitWorld, own_world
from rlinfer_core.errors import EngineDead, EngineOutOfMemory
from rlinfer_core.types import FinishReason, GenerateRequest, SamplingParams

__all__ = [
    "rlinfer_short_kv_world",
    "rlinfer_small_kv_world",
    "test_batch_larger_than_the_kv_cache_is_served",
    "test_request_larger_than_the_kv_cache_raises_out_of_memory",
]

#: KV bytes of one token of the kit's tiny model: K and V, float32, 2 layers, one KV head of 64
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64
#: 1 MiB (EngineConfig's smallest KV budget): 1024 tokens of the kit's tiny model in float32, 2048
#: in bfloat16 (the GPU runs)
SMALL_KV_BYTES = 1 << 20
#: a context longer than that cache in either dtype (the models get 4096 positions)
LONG_CONTEXT = 4096
#: a context the same cache holds (vLLM keeps one block of it back)
SHORT_CONTEXT = 512


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 300 + 10 for i in range(length)]


def _greedy(length: int, max_tokens: int, offset: int = 0) -> GenerateRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(prompt_token_ids=_prompt(length, offset), sampling=sampling)


@pytest.fixture(scope="module")
def rlinfer_small_kv_world(
    rlinfer_backend: str,
    rlinfer_config_overrides: dict[str, Any],
    rlinfer_report: KitReport,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[KitWorld]:
    """An engine of its own whose KV cache holds fewer tokens than one max_model_len request."""
    overrides = {
        **rlinfer_config_overrides,
        "kv_cache_memory_bytes": SMALL_KV_BYTES,
        "max_model_len": LONG_CONTEXT,
    }
    tmp = Path(tmp_path_factory.mktemp("rlinfer-kit-small-kv"))
    why = "a KV cache smaller than one max_model_len request"
    with own_world(
        rlinfer_backend, overrides, rlinfer_report, tmp, "llama", "small_kv", why, {"max_position_embeddings": 4096}
    ) as world:
        yield world


@pytest.fixture(scope="module")
def rlinfer_short_kv_world(
    rlinfer_backend: str,
    rlinfer_config_overrides: dict[str, Any],
    rlinfer_report: KitReport,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[KitWorld]:
    """An engine of its own on the same tiny KV budget, with a context the cache holds."""
    overrides = {
        **rlinfer_config_overrides,
        "kv_cache_memory_bytes": SMALL_KV_BYTES,
        "max_model_len": SHORT_CONTEXT,
    }
    tmp = Path(tmp_path_factory.mktemp("rlinfer-kit-short-kv"))
    with own_world(rlinfer_backend, overrides, rlinfer_report, tmp, "llama", "short_kv", "a tiny KV budget") as world:
        yield world


@pytest.mark.hooks("rlinfer_generate")
def test_request_larger_than_the_kv_cache_raises_out_of_memory(rlinfer_small_kv_world: KitWorld) -> None:
    world = rlinfer_small_kv_world
    info = world.engine.model_info
    assert info is not None
    capacity = info.kv_capacity_tokens
    room = capacity if capacity is not None else SMALL_KV_BYTES // KV_BYTES_PER_TOKEN
    fits = _greedy(16, 8, offset=1)
    beyond = {
        "prompt beyond the budget": _greedy(room + 8, 4),
        "prompt + max_tokens beyond the budget": _greedy(room - 20, 100),
    }
    if capacity is None:
        # the engine says its KV cache holds a max_model_len request whatever the budget (an engine
        # without a paged cache): then it must serve these whole, at parity
        requests = list(beyond.values())
        world.check_parity("beyond_kv_budget", requests, world.generate(requests))
        return
    assert capacity < LONG_CONTEXT, f"kv_capacity_tokens={capacity} is only reported below max_model_len"
    for what, request in beyond.items():
        for batch in ([request], [fits, request]):  # alone, and beside a request that fits
            with pytest.raises(EngineOutOfMemory) as raised:
                world.engine.generate(batch)
            assert not raised.value.transient, f"{what}: it can never fit, so it is not transient"
            assert raised.value.capacity_tokens == capacity, what
    assert not world.engine.in_flight, "a refused request must leave nothing in flight"
    try:
        world.engine.check_health()
    except EngineDead as exc:  # pragma: no cover - the failure this test exists to catch
        pytest.fail(f"the engine died of a request that did not fit: {exc}")
    world.generate_and_check("after_out_of_memory")  # serves on, same weights, at oracle parity
    right_under = _greedy(capacity - 40, 40, offset=3)  # the largest kind that fits is served whole
    [completion] = world.generate([right_under])
    assert len(completion.token_ids) == 40 and completion.finish_reason is FinishReason.LENGTH
    world.check_parity("kv_cache_full_request", [right_under], [completion])


@pytest.mark.hooks("rlinfer_generate")
def test_batch_larger_than_the_kv_cache_is_served(rlinfer_short_kv_world: KitWorld) -> None:
    world = rlinfer_short_kv_world
    requests = [_greedy(300, 48, offset=i) for i in range(6)]  # 6 x 348 tokens, about twice the cache
    completions = world.generate(requests)
    assert [len(c.token_ids) for c in completions] == [48] * 6, "every request of the batch is served whole"
    assert all(c.finish_reason is FinishReason.LENGTH for c in completions)
    world.check_parity("kv_cache_pressure_batch", requests, completions)
    world.engine.check_health()
