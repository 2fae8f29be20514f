"""Issue 28's sampling controls in the core: validation of stop_regex, include_stop_str_in_output,
EBNF grammars and priority, the capabilities a request needs, and the over-sampling helper (on a
test double of an engine's generate/abort, not an engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from rlinfer_core.errors import InvalidRequest, UnsupportedCapability
from rlinfer_core.over_sample import finished_needed, generate_over_sampled
from rlinfer_core.preflight import request_capabilities
from rlinfer_core.structured import StructuredKind, StructuredOutput
from rlinfer_core.types import (
    Capabilities,
    Capability,
    Completion,
    EngineConfig,
    FinishReason,
    GenerateRequest,
    SamplingParams,
)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (["a*"], "matches the empty string"),
        (["("], "does not compile"),
        ([""], "non-empty string"),
        ([3], "non-empty string"),
        (["x" * 257], "at most 256 bytes"),
        (["x"] * 33, "at most 32 patterns"),
    ],
)
def test_stop_regex_is_validated(value: Any, text: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(stop_regex=value)
    assert info.value.field == "stop_regex"
    assert text in str(info.value)


def test_stop_regex_and_include_stop_str_are_kept() -> None:
    s = SamplingParams(stop_regex=r"\d+", include_stop_str_in_output=True)
    assert s.stop_regex == (r"\d+",)
    assert s.include_stop_str_in_output is True
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(include_stop_str_in_output=1)
    assert info.value.field == "include_stop_str_in_output"


def test_ebnf_grammar_is_a_structured_kind() -> None:
    grammar = 'root ::= "yes" | "no"'
    s = SamplingParams(structured={"ebnf": grammar})
    assert s.structured == StructuredOutput.ebnf(grammar)
    assert s.structured is not None and s.structured.kind is StructuredKind.EBNF
    for bad, text in ((" ", "non-empty"), (3, "non-empty"), ('answer ::= "yes"', "rule 'root'")):
        with pytest.raises(InvalidRequest) as info:
            StructuredOutput.ebnf(bad)  # type: ignore[arg-type]
        assert info.value.field == "structured.ebnf"
        assert text in str(info.value)


@pytest.mark.parametrize("value", [True, 1.5, 2**31, -(2**31) - 1, "1"])
def test_priority_is_validated(value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        GenerateRequest(prompt_token_ids=[1], priority=value)
    assert info.value.field == "priority"


def test_priority_scheduling_is_a_bool() -> None:
    assert EngineConfig(model="m", priority_scheduling=True).priority_scheduling
    with pytest.raises(InvalidRequest):
        EngineConfig(model="m", priority_scheduling="yes")


def test_requests_need_the_new_capabilities() -> None:
    plain = GenerateRequest(prompt_token_ids=[1])
    assert not {Capability.STOP_REGEX, Capability.GRAMMAR_EBNF, Capability.PRIORITY} & set(request_capabilities(plain))
    assert Capability.STOP_REGEX in request_capabilities(
        GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(stop_regex="x"))
    )
    ebnf = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(structured={"ebnf": 'root ::= "a"'}))
    assert Capability.GRAMMAR_EBNF in request_capabilities(ebnf)
    regex = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(structured={"regex": "a"}))
    assert Capability.GRAMMAR_EBNF not in request_capabilities(regex)
    assert Capability.PRIORITY in request_capabilities(GenerateRequest(prompt_token_ids=[1], priority=-3))
    assert Capability.PRIORITY not in request_capabilities(GenerateRequest(prompt_token_ids=[1], priority=0))


def test_finished_needed() -> None:
    assert finished_needed(8, 0.5) == 4
    assert finished_needed(5, 0.8) == 4
    assert finished_needed(3, 0.5) == 2
    assert finished_needed(3, 0.01) == 1
    assert finished_needed(3, 1.0) == 3
    for bad in (0.0, 1.5, -1, True, "0.5"):
        with pytest.raises(InvalidRequest):
            finished_needed(3, bad)  # type: ignore[arg-type]


class SlowDoubleEngine:
    """TEST DOUBLE (not an engine): each request takes ``max_tokens`` ticks of 10 ms, one token
    per tick; abort ends it at once with the tokens made so far."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.events: dict[str, asyncio.Event] = {}

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        (request,) = requests
        stop = self.events.setdefault(request.request_id, asyncio.Event())
        tokens: list[int] = []
        while len(tokens) < request.sampling.max_tokens and not stop.is_set():
            await asyncio.sleep(0.01)
            tokens.append(len(tokens))
        reason = FinishReason.ABORT if stop.is_set() else FinishReason.LENGTH
        return [Completion(request.request_id, 0, (1,), tuple(tokens), (0.0,) * len(tokens), reason)]

    async def abort(self, request_ids: Sequence[str] | str | None = None) -> None:
        assert isinstance(request_ids, list)
        self.aborted += request_ids
        for rid in request_ids:
            self.events.setdefault(rid, asyncio.Event()).set()


def _caps(*supported: Capability) -> Capabilities:
    return Capabilities("double", "0", "cpu", frozenset(supported))


def test_over_sample_returns_every_completion_and_aborts_the_tail() -> None:
    engine = SlowDoubleEngine()
    requests = [
        GenerateRequest(
            prompt_token_ids=[1], sampling=SamplingParams(max_tokens=2 if i % 2 else 500), request_id=f"r{i}"
        )
        for i in range(8)
    ]
    completions = asyncio.run(generate_over_sampled(engine, requests, 0.5, _caps(Capability.ABORT), lambda r: None))
    assert [c.request_id for c in completions] == [f"r{i}" for i in range(8)]
    assert [c.finish_reason for c in completions] == [FinishReason.ABORT, FinishReason.LENGTH] * 4
    assert sorted(engine.aborted) == ["r0", "r2", "r4", "r6"]
    assert all(len(c.token_ids) < 500 for c in completions[::2])


def test_over_sample_checks_first_and_needs_abort() -> None:
    engine = SlowDoubleEngine()
    requests = [GenerateRequest(prompt_token_ids=[1], request_id=f"r{i}") for i in range(2)]

    def refuse(request: GenerateRequest) -> None:
        raise InvalidRequest("prompt_token_ids", "refused")

    with pytest.raises(InvalidRequest):
        asyncio.run(generate_over_sampled(engine, requests, 0.5, _caps(Capability.ABORT), refuse))
    assert engine.events == {}, "nothing was submitted"
    with pytest.raises(UnsupportedCapability):
        asyncio.run(generate_over_sampled(engine, requests, 0.5, _caps(), lambda r: None))
    done = asyncio.run(generate_over_sampled(engine, requests, 1.0, _caps(), lambda r: None))
    assert [c.finish_reason for c in done] == [FinishReason.LENGTH] * 2, "no abort needed at rate 1"


def test_rlinfer_serve_maps_the_new_fields() -> None:
    """The dialects' conversions (no engine): vLLM's /inference/v1/generate and OpenAI bodies,
    SGLang's /generate (its priority order is higher first)."""
    from rlinfer_server.constraints import structured_constraint
    from rlinfer_server.schemas import StructuredOutputsIn
    from rlinfer_server.sglang_generate import generate_plan
    from rlinfer_server.sglang_schemas import SglGenerateBody
    from rlinfer_server.vllm_generate import VllmGenerateBody, generate_requests

    vllm = VllmGenerateBody.model_validate(
        {
            "token_ids": [1, 2],
            "priority": -2,
            "sampling_params": {"max_tokens": 4, "stop": ["x"], "include_stop_str_in_output": True},
        }
    )
    request = generate_requests(vllm)
    assert request.priority == -2 and request.sampling.include_stop_str_in_output
    grammar = 'root ::= "a"'
    assert structured_constraint(None, StructuredOutputsIn(grammar=grammar)) == StructuredOutput.ebnf(grammar)
    sgl = SglGenerateBody.model_validate(
        {
            "input_ids": [1, 2],
            "priority": 3,
            "sampling_params": {"max_new_tokens": 4, "stop_regex": r"\d", "ebnf": grammar, "no_stop_trim": True},
        }
    )
    (sgl_request,) = generate_plan(sgl, tokens=None).requests  # type: ignore[arg-type]  # ids: no tokenizer
    assert sgl_request.priority == -3, "SGLang's higher-first order as rlinfer's lower-first"
    assert sgl_request.sampling.stop_regex == (r"\d",)
    assert sgl_request.sampling.include_stop_str_in_output
    assert sgl_request.sampling.structured == StructuredOutput.ebnf(grammar)
