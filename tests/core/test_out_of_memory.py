"""EngineOutOfMemory in the core: the facade's KV-room check, and the optional retry of transient
refusals (rlinfer_core.oom_retry), on a TEST-ONLY double (doubles/out_of_memory_double.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from out_of_memory_double import KV_CAPACITY, OOM_DOUBLE_INFO, OutOfMemoryDoubleBackend
from recording_double import MAX_LEN

from rlinfer_core.engine import AsyncEngine
from rlinfer_core.errors import EngineOutOfMemory, InvalidRequest
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.oom_retry import OutOfMemoryRetry, retrying_out_of_memory
from rlinfer_core.preflight import check_kv_room
from rlinfer_core.types import EngineConfig, GenerateRequest, SamplingParams


class RecordedSleeps:
    """Stands in for asyncio.sleep: records each wait, waits for nothing."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


class ScriptedCall:
    """A call that raises the scripted errors in turn, then returns "done"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def transient() -> EngineOutOfMemory:
    return EngineOutOfMemory("busy", transient=True)


def test_backoff_grows_to_its_cap() -> None:
    policy = OutOfMemoryRetry(attempts=5, initial_backoff_s=0.5, max_backoff_s=3.0, multiplier=2.0)
    assert list(policy.delays()) == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert list(OutOfMemoryRetry().delays()) == [], "off by default"


def test_retry_settings_are_validated() -> None:
    with pytest.raises(InvalidRequest, match="attempts"):
        OutOfMemoryRetry(attempts=-1)
    with pytest.raises(InvalidRequest, match="multiplier"):
        OutOfMemoryRetry(multiplier=0.5)


def test_transient_refusals_are_retried_until_the_call_passes() -> None:
    call, sleeps = ScriptedCall(transient(), transient()), RecordedSleeps()
    policy = OutOfMemoryRetry(attempts=3, initial_backoff_s=0.1)
    assert asyncio.run(retrying_out_of_memory(call, policy, sleeps)) == "done"
    assert call.calls == 3 and sleeps.waits == [0.1, 0.2]


def test_retries_are_bounded() -> None:
    call, sleeps = ScriptedCall(*(transient() for _ in range(5))), RecordedSleeps()
    with pytest.raises(EngineOutOfMemory):
        asyncio.run(retrying_out_of_memory(call, OutOfMemoryRetry(attempts=2), sleeps))
    assert call.calls == 3 and len(sleeps.waits) == 2


@pytest.mark.parametrize(
    "error",
    [EngineOutOfMemory("never fits", transient=False, needed_tokens=9, capacity_tokens=8), InvalidRequest("x", "bad")],
    ids=["never-fits", "other-error"],
)
def test_only_transient_out_of_memory_is_retried(error: Exception) -> None:
    call, sleeps = ScriptedCall(error), RecordedSleeps()
    with pytest.raises(type(error)):
        asyncio.run(retrying_out_of_memory(call, OutOfMemoryRetry(attempts=3), sleeps))
    assert call.calls == 1 and sleeps.waits == []


def test_kv_room_counts_prompt_and_output_up_to_the_context() -> None:
    info = ModelInfo(vocab_size=10, max_model_len=100, kv_capacity_tokens=60)
    check_kv_room(50, 10, info)  # exactly fits
    with pytest.raises(EngineOutOfMemory) as raised:
        check_kv_room(50, 11, info)
    assert (raised.value.transient, raised.value.needed_tokens, raised.value.capacity_tokens) == (False, 61, 60)
    check_kv_room(10, 10_000, ModelInfo(10, 100, kv_capacity_tokens=100))  # generation stops at the context
    check_kv_room(90, 10_000, ModelInfo(10, 100))  # no KV limit reported: nothing to check


@pytest.fixture
def oom_double(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rlinfer_core.engine.get_backend", lambda name: OOM_DOUBLE_INFO)


async def _generate(request: GenerateRequest, failures: int, **open_kwargs: Any) -> tuple[Any, list[str]]:
    config = EngineConfig(model="m", request_timeout_s=5.0, engine_kwargs={"transient_failures": failures})
    engine = await AsyncEngine.open("oom-double", config, load_entry_point_plugins=False, **open_kwargs)
    try:
        backend = engine._backend
        assert isinstance(backend, OutOfMemoryDoubleBackend)
        try:
            return await engine.generate([request]), backend.names()
        except EngineOutOfMemory as exc:
            return exc, backend.names()
    finally:
        await engine.shutdown()


def _request(prompt_tokens: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1] * prompt_tokens, sampling=SamplingParams(max_tokens=max_tokens))


@pytest.mark.usefixtures("oom_double")
def test_facade_refuses_a_request_beyond_the_kv_cache_before_the_backend_sees_it() -> None:
    assert KV_CAPACITY < MAX_LEN
    result, calls = asyncio.run(_generate(_request(KV_CAPACITY - 2, 4), failures=0))
    assert isinstance(result, EngineOutOfMemory) and not result.transient
    assert "generate" not in calls and "generate_turned_away" not in calls


@pytest.mark.usefixtures("oom_double")
def test_facade_does_not_retry_by_default() -> None:
    result, calls = asyncio.run(_generate(_request(4, 4), failures=1))
    assert isinstance(result, EngineOutOfMemory) and result.transient
    assert calls.count("generate_turned_away") == 1 and "generate" not in calls


@pytest.mark.usefixtures("oom_double")
def test_facade_retries_transient_refusals_when_asked() -> None:
    policy = OutOfMemoryRetry(attempts=3, initial_backoff_s=0.01)
    result, calls = asyncio.run(_generate(_request(4, 4), failures=2, oom_retry=policy))
    assert isinstance(result, list) and len(result) == 1 and len(result[0].token_ids) == 4
    assert calls.count("generate_turned_away") == 2 and calls.count("generate") == 1


def test_out_of_memory_pickles_whole() -> None:
    import pickle

    exc = EngineOutOfMemory("no room", transient=False, needed_tokens=9, capacity_tokens=8)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is EngineOutOfMemory and str(back) == "no room"
    assert (back.transient, back.needed_tokens, back.capacity_tokens) == (False, 9, 8)
