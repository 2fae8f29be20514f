"""Observers cannot change outcomes; pause covers every accepted request; per-token versions;
integrity readback. All against the TEST-ONLY recording double (see recording_double.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch
from recording_double import DOUBLE_INFO, INSTANCES, RecordingDoubleBackend

from rlinfer_core import hookimpl
from rlinfer_core.checksum import WeightChecksum, tensor_checksum, verify
from rlinfer_core.engine import AsyncEngine, request_capabilities
from rlinfer_core.errors import InvalidRequest, WeightUpdateError
from rlinfer_core.types import (
    Capability,
    Completion,
    EngineConfig,
    FinishReason,
    GenerateRequest,
    LogprobsMode,
    PauseMode,
    SamplingParams,
)
from rlinfer_core.weights import NamedTensors


class HijackingObserver:
    """Implements an operation hook: must be refused, never allowed to answer generate."""

    @hookimpl
    async def rlinfer_generate(self, requests: Any) -> list[Completion]:
        return []


class RaisingObserver:
    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def rlinfer_on_generate_done(self, backend: str, requests: Any, completions: Any, seconds: float) -> None:
        self.calls += 1
        raise RuntimeError("observer bug")

    @hookimpl
    def rlinfer_on_weights_updated(self, backend: str, version: int, transport: str, nbytes: int) -> None:
        self.calls += 1
        raise RuntimeError("observer bug")

    @hookimpl
    def rlinfer_on_weight_update_failed(self, backend: str, transport: str, error: Exception) -> None:
        self.calls += 1
        raise RuntimeError("observer bug")


class CountingObserver:
    def __init__(self) -> None:
        self.done = 0

    @hookimpl
    def rlinfer_on_generate_done(self, backend: str, requests: Any, completions: Any, seconds: float) -> None:
        self.done += 1


def engine(*plugins: Any, **options: Any) -> AsyncEngine:
    return AsyncEngine(DOUBLE_INFO, RecordingDoubleBackend(**options), EngineConfig(model="m"), plugins)


def request(max_tokens: int = 3, **kw: Any) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=max_tokens), **kw)


def test_observer_implementing_generate_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="rlinfer_generate"):
        engine(HijackingObserver())


def test_refused_entry_point_observer_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        e = AsyncEngine(DOUBLE_INFO, RecordingDoubleBackend(), EngineConfig(model="m"), (), [HijackingObserver()])
    completions = asyncio.run(e.generate([request()]))
    assert len(completions) == 1 and len(completions[0].token_ids) == 3
    assert "refused" in caplog.text


def test_raising_observer_changes_no_outcome(caplog: pytest.LogCaptureFixture) -> None:
    raising, counting = RaisingObserver(), CountingObserver()
    e = engine(raising, counting)

    async def scenario() -> tuple[list[Completion], int]:
        completions = await e.generate([request()])
        version = await e.update_weights(NamedTensors.of({"w": torch.zeros(2, 2)}))
        return completions, version

    with caplog.at_level(logging.ERROR):
        completions, version = asyncio.run(scenario())
    assert len(completions) == 1 and completions[0].token_ids
    assert version == 1 == e.weight_version
    assert counting.done == 1, "observers after a raising one are still called"
    assert raising.calls == 2
    assert "observer bug" in caplog.text


def test_raising_observer_does_not_replace_a_weight_update_error() -> None:
    e = engine(RaisingObserver(), fail_update=True)
    with pytest.raises(WeightUpdateError):
        asyncio.run(e.update_weights(NamedTensors.of({"w": torch.zeros(2, 2)})))
    assert e.weight_version == 0


def test_pause_wait_covers_a_request_accepted_but_not_yet_in_the_engine() -> None:
    e = engine(generate_delay_s=0.2)

    async def scenario() -> tuple[bool, list[str]]:
        task = asyncio.ensure_future(e.generate([request(request_id="early")]))
        await asyncio.sleep(0)  # generate has accepted it; the backend may not have seen it yet
        assert "early" in e.in_flight, "premise: the request is accepted before pause"
        await e.pause(PauseMode.WAIT)
        done = task.done()
        await e.resume()
        await task
        return done, [c[0] for c in INSTANCES[-1].calls]

    done, calls = asyncio.run(scenario())
    assert done, "pause(wait) returned while an accepted request was still running"
    assert calls.index("generate") < calls.index("pause")


def test_requests_wait_at_the_gate_while_paused() -> None:
    e = engine()

    async def scenario() -> tuple[bool, bool]:
        await e.pause(PauseMode.ABORT)
        held = request()
        task = asyncio.ensure_future(e.generate([held]))
        await asyncio.sleep(0.05)  # plenty for the double to answer were the request not held
        waiting = held.request_id in e._requests.admission.waiting and not task.done()
        assert "generate" not in [c[0] for c in INSTANCES[-1].calls], "the engine has not seen it"
        await e.resume()
        await asyncio.wait_for(task, 5)
        return waiting, task.done()

    waiting, finished = asyncio.run(scenario())
    assert waiting and finished


def test_pause_abort_aborts_accepted_requests_by_id() -> None:
    e = engine(generate_delay_s=0.2)

    async def scenario() -> list[Any]:
        task = asyncio.ensure_future(e.generate([request(request_id="r1")]))
        await asyncio.sleep(0)
        await e.pause(PauseMode.ABORT)
        await e.resume()
        await task
        return INSTANCES[-1].calls

    calls = asyncio.run(scenario())
    assert ("abort", ["r1"]) in calls


def test_token_versions_filled_and_weight_version_is_the_newest() -> None:
    e = engine()
    out = asyncio.run(e.generate([request(max_tokens=4)]))
    assert out[0].token_versions == (0, 0, 0, 0) and out[0].weight_version == 0
    stamped = e._requests.stamp(
        Completion("r", 0, (1,), (5, 6, 7), (-1.0,) * 3, FinishReason.LENGTH, token_versions=(2, 2, 3))
    )
    assert stamped.weight_version == 3 and stamped.token_versions == (2, 2, 3)


def test_update_passes_the_target_version_to_the_backend() -> None:
    e = engine()
    asyncio.run(e.update_weights(NamedTensors.of({"w": torch.zeros(2, 2)}), version=7))
    update = next(arg for name, arg in INSTANCES[-1].calls if name == "update_weights")
    assert update.version == 7


@pytest.mark.parametrize(
    "sampling,capability",
    [
        ({"min_p": 0.1}, Capability.SAMPLING_MIN_P),
        ({"repetition_penalty": 1.2}, Capability.SAMPLING_PENALTIES),
        ({"presence_penalty": 0.5}, Capability.SAMPLING_PENALTIES),
        ({"logit_bias": {3: 1.0}}, Capability.SAMPLING_LOGIT_BIAS),
        ({"allowed_token_ids": [1, 2]}, Capability.SAMPLING_LOGIT_BIAS),
        ({"logprobs_mode": "raw"}, Capability.LOGPROBS_RAW),
        ({"temperature": 1.0, "top_p": 0.5}, Capability.LOGPROBS_PROCESSED),
    ],
)
def test_new_sampling_fields_need_their_capability(sampling: dict[str, Any], capability: Capability) -> None:
    r = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(**sampling))
    assert capability in request_capabilities(r)


def test_greedy_truncation_needs_no_processed_capability() -> None:
    r = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(temperature=0.0, top_k=3))
    assert Capability.LOGPROBS_PROCESSED not in request_capabilities(r)


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {3: 500.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias"),
        ({"logit_bias": [3]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
        ({"logprobs_mode": "logits"}, "logprobs_mode"),
    ],
)
def test_bad_sampling_values_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**fields)
    assert info.value.field == field


def test_sampling_modes_and_bias_normalise() -> None:
    s = SamplingParams(logit_bias={9: 1.0, 2: -1.0}, logprobs_mode="raw")
    assert s.logit_bias == ((2, -1.0), (9, 1.0)) and s.logprobs_mode is LogprobsMode.RAW
    assert s.biased and not s.penalised and not s.truncates


def test_checksum_is_bitwise_and_dtype_aware() -> None:
    t = torch.randn(5, 3)
    same = tensor_checksum(t.clone())
    assert tensor_checksum(t) == same
    assert tensor_checksum(t + 1e-7) != same
    as_bf16 = tensor_checksum(t, "bfloat16")
    assert as_bf16.dtype == "bfloat16" and as_bf16 == tensor_checksum(t.to(torch.bfloat16))


def test_verify_checks_a_tied_head_against_the_embedding() -> None:
    emb, head = torch.randn(8, 4), torch.randn(8, 4)
    served = {"model.embed_tokens.weight": tensor_checksum(emb), "lm_head.weight": tensor_checksum(head)}
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    result = verify(served, {"model.embed_tokens.weight": emb}, tied)
    assert result.checked == ("model.embed_tokens.weight", "lm_head.weight")
    assert result.mismatched == ("lm_head.weight",) and not result.ok
    served["lm_head.weight"] = tensor_checksum(emb)
    assert verify(served, {"model.embed_tokens.weight": emb}, tied).ok
    missing = verify({}, {"x": emb})
    assert missing.missing == ("x",) and not missing.ok
    assert isinstance(served["lm_head.weight"], WeightChecksum)


def test_abort_releases_a_request_waiting_at_the_pause_gate() -> None:
    e = engine()

    async def scenario() -> list[Completion]:
        await e.pause(PauseMode.KEEP)
        task = asyncio.ensure_future(e.generate([request(request_id="held")]))
        while "held" not in e._requests.admission.waiting:
            await asyncio.sleep(0)
        assert not task.done(), "premise: the request waits at the gate"
        await e.abort(["held"])
        out = await asyncio.wait_for(task, 5)
        await e.resume()
        return out

    out = asyncio.run(scenario())
    assert out[0].finish_reason is FinishReason.ABORT and out[0].token_ids == ()
    assert "generate" not in [c[0] for c in INSTANCES[-1].calls], "the engine never saw it"


def test_sync_calls_after_shutdown_raise_engine_dead(tmp_path: Any) -> None:
    import threading

    from rlinfer_core.errors import EngineDead
    from rlinfer_core.sync_engine import Engine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sync = Engine(engine(), loop, thread)
    sync.shutdown()
    with pytest.raises(EngineDead):
        sync.check_health()
    with pytest.raises(EngineDead):
        sync.generate([request()])
