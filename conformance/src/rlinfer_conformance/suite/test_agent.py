"""Agent rollouts (issue 13): sessions with token continuity, scoring, tool calls, structured output,
LoRA. Every model token is checked against the oracle."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from rlinfer_conformance.agent_oracle import add_merged_lora, make_lora_tensors, raw_logprobs, save_peft_dir
from rlinfer_conformance.world import BASE, LOGPROB_TOLERANCE, OTHER, KitWorld
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.scoring import ScoreRequest
from rlinfer_core.session import NO_VERSION, SessionResult
from rlinfer_core.tools import ToolSpec
from rlinfer_core.types import Capability, ChatMessage, Completion, GenerateRequest, SamplingParams

__all__ = [
    "test_session_episode_with_scripted_tool",
    "test_session_survives_weight_update",
    "test_score_matches_oracle",
    "test_tool_calls_use_the_engine_parser",
    "test_chat_request_renders_the_tool_section",
    "test_structured_outputs_hold",
    "test_structured_tool_call_is_parsed",
    "test_lora_matches_merged_oracle",
]

ADD = ToolSpec(
    "add",
    "add two integers",
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _greedy_request(completion: Completion, sampling: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=completion.prompt_token_ids, sampling=sampling, request_id=completion.request_id
    )


def check_continuity(world: KitWorld, episode: SessionResult, tools: Sequence[ToolSpec] | None) -> None:
    """The session's tokens are the whole-conversation rendering: same text, and the same ids once
    the model's own spans are tokenised the canonical way; the loss mask covers model spans only."""
    tok = world.oracle.tokenizer
    n = len(episode.token_ids)
    assert len(episode.loss_mask) == len(episode.logprobs) == len(episode.token_versions) == n
    whole = tok.apply_chat_template(
        [dict(m) for m in episode.messages], tools=[t.to_openai() for t in tools] if tools else None, tokenize=False
    )
    assert tok.decode(list(episode.token_ids), skip_special_tokens=False) == whole
    canonical: list[int] = []
    model: list[int] = []
    for turn in episode.turns:
        span = list(episode.token_ids[turn.start : turn.end])
        if turn.kind == "model":
            model += range(turn.start, turn.end)
            canonical += tok(tok.decode(span), add_special_tokens=False).input_ids
            assert turn.completion is not None
            assert list(episode.logprobs[turn.start : turn.end]) == list(turn.completion.logprobs)
        else:
            canonical += span
            assert tok(turn.text, add_special_tokens=False).input_ids == span, "environment text tokenised on its own"
    assert canonical == tok(whole, add_special_tokens=False).input_ids
    assert [i for i in range(n) if episode.loss_mask[i] == 1] == model
    assert all(episode.token_versions[i] == NO_VERSION for i in range(n) if i not in set(model))


@pytest.mark.requires(Capability.SESSIONS)
@pytest.mark.hooks("rlinfer_generate")
def test_session_episode_with_scripted_tool(rlinfer_world: KitWorld) -> None:
    w = rlinfer_world
    parser = "hermes" if w.supports(Capability.TOOLS) else None
    session = w.engine.session(tools=[ADD], tool_parser=parser, sampling=GREEDY)
    session.add_message("user", "what is 2 + 3? use the tool.")
    requests, completions = [], []
    for k in range(3):
        held = session.token_ids
        turn = session.generate()
        assert turn.completion is not None
        prompt = turn.completion.prompt_token_ids
        assert prompt == session.token_ids[: turn.start] and prompt[: len(held)] == held, "prompt = tokens so far"
        assert (turn.tool_calls is not None) == (parser is not None)
        requests.append(_greedy_request(turn.completion))
        completions.append(turn.completion)
        if k < 2:
            session.add_tool_result(str(5 + k), name="add")  # the scripted tool answers
    episode = session.result()
    assert [t.kind for t in episode.turns].count("model") == 3
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert episode.exact, [t.note for t in episode.turns if not t.exact]
    check_continuity(w, episode, [ADD])
    assert {episode.token_versions[i] for i, m in enumerate(episode.loss_mask) if m} == {w.engine.weight_version}
    w.check_parity("session_turns", requests, completions)


@pytest.mark.requires(Capability.SESSIONS, Capability.WEIGHTS_TENSORS)
@pytest.mark.hooks("rlinfer_generate", "rlinfer_update_weights")
def test_session_survives_weight_update(rlinfer_base_weights: KitWorld) -> None:
    w = rlinfer_base_weights
    session = w.engine.session([{"role": "user", "content": "hello"}], sampling=GREEDY)
    first = session.generate()
    version = w.update(Capability.WEIGHTS_TENSORS, OTHER)
    session.add_message("user", "and now?")
    second = session.generate()
    assert first.completion is not None and second.completion is not None
    episode = session.result()
    assert set(episode.token_versions[first.start : first.end]) == {version - 1}
    assert set(episode.token_versions[second.start : second.end]) == {version}
    check_continuity(w, episode, None)
    for key, completion in ((BASE, first.completion), (OTHER, second.completion)):
        parity = w.oracle.check(key, _greedy_request(completion), completion)
        assert not parity.argmax_mismatches, parity.argmax_mismatches
        assert parity.max_abs_logprob_delta <= LOGPROB_TOLERANCE, (key, parity.max_abs_logprob_delta)


@pytest.mark.requires(Capability.SCORE)
@pytest.mark.hooks("rlinfer_generate")
def test_score_matches_oracle(rlinfer_world: KitWorld) -> None:
    w = rlinfer_world
    generated = w.generate(w.greedy_requests(max_tokens=8))
    requests = [ScoreRequest(c.prompt_token_ids, c.token_ids) for c in generated]
    requests.append(ScoreRequest([1, 2, 3], [w.vocab_size - 1, 7, 7, 40]))  # unlikely tokens too
    scores = w.engine.score(requests)
    assert [s.request_id for s in scores] == [r.request_id for r in requests]
    worst = 0.0
    for request, score in zip(requests, scores, strict=True):
        assert score.weight_version == w.engine.weight_version
        expected = raw_logprobs(w.oracle, w.current, request.prompt_token_ids, request.completion_token_ids)
        assert len(score.logprobs) == len(expected)
        worst = max(worst, *(abs(a - b) for a, b in zip(score.logprobs, expected, strict=True)))
    for c, score in zip(generated, scores, strict=False):  # greedy logprobs are raw logprobs
        assert max(abs(a - b) for a, b in zip(c.logprobs, score.logprobs, strict=True)) <= 2 * LOGPROB_TOLERANCE
    w.report.record_parity("score", worst, sum(len(s.logprobs) for s in scores), 0)
    assert worst <= LOGPROB_TOLERANCE, worst


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
LLAMA_CALL = '{"name": "add", "parameters": {"a": 2, "b": 3}}'


@pytest.mark.requires(Capability.TOOLS)
@pytest.mark.hooks("rlinfer_parse_tool_calls")
def test_tool_calls_use_the_engine_parser(rlinfer_world: KitWorld) -> None:
    w = rlinfer_world
    for parser, text in (("hermes", f"sure {CALL}"), ("qwen", f"sure\n{CALL}"), ("llama", LLAMA_CALL)):
        found = w.engine.parse_tool_calls(text, parser, [ADD])
        assert [c.name for c in found.calls] == ["add"], (parser, found)
        call = found.calls[0]
        assert call.ok and dict(call.arguments or {}) == {"a": 2, "b": 3}, (parser, call)
        assert json.loads(call.arguments_json or "null") == {"a": 2, "b": 3}
    for text in ('<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>', "<tool_call>not json"):
        found = w.engine.parse_tool_calls(text, "hermes", [ADD])  # never raises
        assert found.calls and not found.calls[0].ok and found.calls[0].raw, (text, found)
    wrong = w.engine.parse_tool_calls(CALL.replace('"b": 3', '"b": "x"'), "hermes", [ADD])
    assert wrong.calls and "schema" in (wrong.calls[0].error or "")
    plain = w.engine.parse_tool_calls("no call here", "hermes", [ADD])
    assert plain.calls == () and plain.content == "no call here"


@pytest.mark.requires(Capability.TOOLS, Capability.CHAT)
@pytest.mark.hooks("rlinfer_generate")
def test_chat_request_renders_the_tool_section(rlinfer_world: KitWorld) -> None:
    w = rlinfer_world
    messages = [ChatMessage("user", "what is 2 + 3?")]
    request = GenerateRequest(messages=messages, tools=[ADD], tool_parser="hermes", sampling=GREEDY)
    (c,) = w.generate([request])
    expected = w.oracle.tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 2 + 3?"}], tools=[ADD.to_openai()], add_generation_prompt=True
    )
    ids = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert list(c.prompt_token_ids) == list(ids), "the template's tool section must be rendered"
    assert c.tool_calls is not None and c.tool_calls.parser == "hermes"
    w.check_parity(None, [_greedy_request(c)], [c])


STRUCTURED = (
    {
        "json_schema": {
            "type": "object",
            # bounded: an unbounded integer lets a random model write digits until max_tokens
            "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
            "required": ["answer", "ok"],
            "additionalProperties": False,
        }
    },
    {"regex": r"(yes|no), [0-9]{1,3}"},
    {"choice": ["red", "green", "blue"]},
)


def _text(w: KitWorld, c: Completion) -> str:
    ids = [t for t in c.token_ids if t not in w.eos_ids]
    text: str = w.oracle.tokenizer.decode(ids, skip_special_tokens=True)
    return text


@pytest.mark.requires(Capability.STRUCTURED)
@pytest.mark.hooks("rlinfer_generate")
@pytest.mark.parametrize("constraint", STRUCTURED, ids=["json_schema", "regex", "choice"])
def test_structured_outputs_hold(rlinfer_world: KitWorld, constraint: dict[str, Any]) -> None:
    w = rlinfer_world
    raw = w.supports(Capability.LOGPROBS_RAW)
    requests = [
        GenerateRequest(
            prompt_token_ids=p,
            sampling=SamplingParams(
                temperature=t, max_tokens=64, structured=constraint, logprobs_mode="raw" if raw else "processed"
            ),
        )
        for p in w.prompts()
        for t in (0.0, 1.0)
    ]
    completions = w.generate(requests)
    for request, c in zip(requests, completions, strict=True):
        assert request.sampling.structured is not None
        assert request.sampling.structured.accepts(_text(w, c)), (constraint, _text(w, c), c.finish_reason)
    if raw:  # raw logprobs ignore the grammar: the oracle's plain log_softmax
        worst = 0.0
        for c in completions:
            expected = raw_logprobs(w.oracle, w.current, c.prompt_token_ids, c.token_ids)
            worst = max(worst, *(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)))
        assert worst <= LOGPROB_TOLERANCE, worst


@pytest.mark.requires(Capability.STRUCTURED, Capability.TOOLS)
@pytest.mark.hooks("rlinfer_generate", "rlinfer_parse_tool_calls")
def test_structured_tool_call_is_parsed(rlinfer_world: KitWorld) -> None:
    w = rlinfer_world
    pattern = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    request = GenerateRequest(
        prompt_token_ids=w.prompts()[0],
        tools=[ADD],
        tool_parser="hermes",
        # the tiny byte-level tokenizer needs ~70 tokens for the call: room for all of it
        sampling=SamplingParams(
            temperature=1.0,
            max_tokens=160,
            seed=1 if w.supports(Capability.SEEDED_SAMPLING) else None,
            structured={"regex": pattern},
        ),
    )
    (c,) = w.generate([request])
    text = _text(w, c)
    assert c.tool_calls is not None and len(c.tool_calls.calls) == 1, (text, c.tool_calls)
    call = c.tool_calls.calls[0]
    assert call.ok and call.name == "add" and set(call.arguments or {}) == {"a", "b"}
    assert text.startswith(call.raw) or call.raw in text, "raw keeps the call's text; token ids stay raw"


@pytest.mark.requires(Capability.LORA)
@pytest.mark.hooks("rlinfer_load_lora", "rlinfer_unload_lora", "rlinfer_list_loras", "rlinfer_generate")
def test_lora_matches_merged_oracle(rlinfer_world: KitWorld) -> None:
    w = rlinfer_world
    rank, alpha = 4, 8.0
    first = make_lora_tensors(w.oracle, w.current, rank, seed=11)
    second = make_lora_tensors(w.oracle, w.current, rank, seed=12)
    add_merged_lora(w.oracle, "lora-a", w.current, first, rank, alpha)
    add_merged_lora(w.oracle, "lora-b", w.current, second, rank, alpha)
    path = save_peft_dir(w.tmp / "lora-a", first, rank, alpha)
    w.engine.load_lora(LoraAdapter("kit", path=str(path)))
    try:
        assert [i.name for i in w.engine.list_loras()] == ["kit"]
        for key, lora in (("lora-a", "kit"), (w.current, None)):
            requests = [
                GenerateRequest(prompt_token_ids=p, sampling=GREEDY, lora=lora, request_id=w.request_id("lora"))
                for p in w.prompts()
            ]
            completions = w.generate(requests)
            parity = w.oracle.check_all(key, requests, completions)
            assert not parity.argmax_mismatches and parity.max_abs_logprob_delta <= LOGPROB_TOLERANCE, (key, parity)
        config = json.loads((path / "adapter_config.json").read_text())
        assert w.engine.update_lora(LoraAdapter("kit", tensors=second, config=config)).version == 1
        requests = [GenerateRequest(prompt_token_ids=p, sampling=GREEDY, lora="kit") for p in w.prompts()]
        parity = w.oracle.check_all("lora-b", requests, w.generate(requests))
        assert not parity.argmax_mismatches and parity.max_abs_logprob_delta <= LOGPROB_TOLERANCE, parity
        w.report.record_parity("lora", parity.max_abs_logprob_delta, parity.tokens_checked, 0)
    finally:
        w.engine.unload_lora("kit")
    assert w.engine.list_loras() == []
