"""Generation: oracle parity, request properties (hypothesis), stops, n, seeds, streaming, chat."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlinfer_conformance.checks import check_batch, parity_applies
from rlinfer_conformance.strategies import valid_requests
from rlinfer_conformance.world import LOGPROB_TOLERANCE, KitWorld, generate_unless_wedged
from rlinfer_core.types import Capability, ChatMessage, FinishReason, GenerateRequest, SamplingParams

__all__ = [
    "test_greedy_matches_oracle_at_start",
    "test_generate_contract_properties",
    "test_sampled_logprobs_are_temperature_scaled",
    "test_ignore_eos_runs_to_max_tokens",
    "test_min_tokens_suppresses_eos",
    "test_stop_token_ids_are_honoured",
    "test_context_length_ends_with_length",
    "test_n_samples_in_order",
    "test_seeded_sampling_reproduces",
    "test_stream_concatenates_to_batch",
    "test_chat_applies_template",
    "test_prompt_logprobs_match_oracle",
    "test_prompt_top_logprobs_match_oracle",
    "test_top_logprobs_match_oracle",
    "test_stop_strings_are_honoured",
    "test_bench_raw_generate_counts_tokens",
]


@pytest.mark.hooks("rlinfer_generate")
def test_greedy_matches_oracle_at_start(rlinfer_world: KitWorld) -> None:
    requests = rlinfer_world.greedy_requests(max_tokens=24)
    completions = rlinfer_world.generate(requests)
    check_batch(rlinfer_world, requests, completions)
    rlinfer_world.check_parity("start", requests, completions)
    assert all(c.weight_version == rlinfer_world.engine.weight_version for c in completions)


@pytest.mark.hooks("rlinfer_generate")
def test_generate_contract_properties(rlinfer_world: KitWorld) -> None:
    caps = rlinfer_world.engine.capabilities
    worst = [0.0, 0.0]
    wedged: list[BaseException] = []

    @given(st.lists(valid_requests(caps, rlinfer_world.vocab_size), min_size=1, max_size=3))
    def prop(requests: list[GenerateRequest]) -> None:
        completions = generate_unless_wedged(rlinfer_world, requests, wedged)
        check_batch(rlinfer_world, requests, completions)
        by_id = {r.request_id: r for r in requests}
        for c in completions:
            r = by_id[c.request_id]
            if parity_applies(r):
                p = rlinfer_world.oracle.check(rlinfer_world.current, r, c)
                assert not p.argmax_mismatches, p.argmax_mismatches
                assert p.max_abs_logprob_delta <= LOGPROB_TOLERANCE, (p.max_abs_logprob_delta, r, c)
                worst[0] = max(worst[0], p.max_abs_logprob_delta)
                worst[1] += p.tokens_checked

    prop()
    rlinfer_world.report.record_parity("property_requests", worst[0], int(worst[1]), 0)


@pytest.mark.hooks("rlinfer_generate")
def test_sampled_logprobs_are_temperature_scaled(rlinfer_world: KitWorld) -> None:
    requests = [
        GenerateRequest(prompt_token_ids=p, sampling=SamplingParams(temperature=t, max_tokens=12))
        for p in rlinfer_world.prompts()
        for t in (0.5, 1.3)
    ]
    completions = rlinfer_world.generate(requests)
    check_batch(rlinfer_world, requests, completions)
    rlinfer_world.check_parity("start_sampled", requests, completions)


def test_ignore_eos_runs_to_max_tokens(rlinfer_world: KitWorld) -> None:
    requests = rlinfer_world.greedy_requests(max_tokens=20, ignore_eos=True)
    completions = rlinfer_world.generate(requests)
    check_batch(rlinfer_world, requests, completions)
    assert all(len(c.token_ids) == 20 and c.finish_reason is FinishReason.LENGTH for c in completions)
    rlinfer_world.check_parity(None, requests, completions)


def test_min_tokens_suppresses_eos(rlinfer_world: KitWorld) -> None:
    eos = rlinfer_world.eos_ids
    requests = [
        GenerateRequest(
            prompt_token_ids=p,
            sampling=SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, stop_token_ids=eos),
        )
        for p in rlinfer_world.prompts()
    ]
    completions = rlinfer_world.generate(requests)
    check_batch(rlinfer_world, requests, completions)
    assert all(len(c.token_ids) == 10 for c in completions)


def test_stop_token_ids_are_honoured(rlinfer_world: KitWorld) -> None:
    full_requests = rlinfer_world.greedy_requests(max_tokens=16, ignore_eos=True)
    full = rlinfer_world.generate(full_requests)
    checked = 0
    for c in full:
        tokens = list(c.token_ids)
        k = next((i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i]), None)
        if k is None:
            continue
        request = GenerateRequest(
            prompt_token_ids=c.prompt_token_ids,
            sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=(tokens[k],)),
        )
        (stopped,) = rlinfer_world.generate([request])
        check_batch(rlinfer_world, [request], [stopped])
        assert stopped.finish_reason is FinishReason.STOP
        assert list(stopped.token_ids) == tokens[: k + 1], "output ends with the stop token id, which is included"
        assert stopped.stop_reason == tokens[k]
        checked += 1
    assert checked >= 3


def test_context_length_ends_with_length(rlinfer_world: KitWorld) -> None:
    room = 3
    prompt = [5 + i % 50 for i in range(rlinfer_world.max_model_len - room)]
    request = GenerateRequest(
        prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    (c,) = rlinfer_world.generate([request])
    assert len(c.token_ids) == room
    assert c.finish_reason is FinishReason.LENGTH


@pytest.mark.requires(Capability.MULTI_SAMPLE)
def test_n_samples_in_order(rlinfer_world: KitWorld) -> None:
    requests = [
        GenerateRequest(prompt_token_ids=p, sampling=SamplingParams(temperature=1.0, max_tokens=8, n=3))
        for p in rlinfer_world.prompts()[:3]
    ]
    completions = rlinfer_world.generate(requests)
    check_batch(rlinfer_world, requests, completions)
    rlinfer_world.check_parity(None, requests, completions)


@pytest.mark.requires(Capability.SEEDED_SAMPLING)
def test_seeded_sampling_reproduces(rlinfer_world: KitWorld) -> None:
    def run(seed: int) -> list[tuple[int, ...]]:
        requests = [
            GenerateRequest(prompt_token_ids=p, sampling=SamplingParams(temperature=1.0, max_tokens=16, seed=seed))
            for p in rlinfer_world.prompts()
        ]
        return [c.token_ids for c in rlinfer_world.generate(requests)]

    first = run(1234)
    assert run(1234) == first, "the same seed must give the same samples"
    others = [run(s) for s in (1, 2)]
    assert any(o != first for o in others), "different seeds should give different samples"


@pytest.mark.requires(Capability.STREAM)
@pytest.mark.hooks("rlinfer_generate_stream")
def test_stream_concatenates_to_batch(rlinfer_world: KitWorld) -> None:
    for request in rlinfer_world.greedy_requests(max_tokens=16):
        (batch,) = rlinfer_world.generate([request])
        deltas = list(rlinfer_world.engine.stream(request))
        assert deltas, "a stream yields at least one delta"
        tokens = [t for d in deltas for t in d.token_ids]
        logprobs = [x for d in deltas for x in d.logprobs]
        assert tokens == list(batch.token_ids)
        assert all(math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE) for a, b in zip(logprobs, batch.logprobs, strict=True))
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert deltas[-1].finish_reason is batch.finish_reason
        assert all(d.request_id == request.request_id and d.index == 0 for d in deltas)


@pytest.mark.requires(Capability.CHAT)
def test_chat_applies_template(rlinfer_world: KitWorld) -> None:
    messages = [ChatMessage("system", "be brief"), ChatMessage("user", "what is 2 + 3?")]
    request = GenerateRequest(messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=8))
    (c,) = rlinfer_world.generate([request])
    expected = rlinfer_world.oracle.tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=True
    )
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert list(c.prompt_token_ids) == list(expected)
    rlinfer_world.check_parity(None, [request], [c])


@pytest.mark.requires(Capability.PROMPT_LOGPROBS)
def test_prompt_logprobs_match_oracle(rlinfer_world: KitWorld) -> None:
    requests = rlinfer_world.greedy_requests(max_tokens=2, prompt_logprobs=True)
    for request, c in zip(requests, rlinfer_world.generate(requests), strict=True):
        assert c.prompt_logprobs is not None
        assert len(c.prompt_logprobs) == len(c.prompt_token_ids)
        assert c.prompt_logprobs[0] is None
        want = rlinfer_world.oracle.prompt_logprobs(rlinfer_world.current, list(c.prompt_token_ids))
        got = c.prompt_logprobs[1:]
        assert all(g is not None and abs(g - w) <= LOGPROB_TOLERANCE for g, w in zip(got, want, strict=True)), (
            request.request_id,
            got,
            want,
        )


@pytest.mark.requires(Capability.TOP_LOGPROBS)
def test_top_logprobs_match_oracle(rlinfer_world: KitWorld) -> None:
    k = 3
    requests = rlinfer_world.greedy_requests(max_tokens=6, logprobs=k)
    for c in rlinfer_world.generate(requests):
        assert c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
        want = rlinfer_world.oracle.top_logprobs(rlinfer_world.current, c.prompt_token_ids, c.token_ids, k)
        for got_row, want_row in zip(c.top_logprobs, want, strict=True):
            assert len(got_row) >= k
            _assert_top_row(rlinfer_world, got_row, want_row)


@pytest.mark.requires(Capability.PROMPT_LOGPROBS, Capability.TOP_LOGPROBS)
def test_prompt_top_logprobs_match_oracle(rlinfer_world: KitWorld) -> None:
    """Teacher scoring (TRL's ``get_sequence_logprobs``): each prompt position's k most likely
    tokens with their logprobs, beside the prompt token's own; the first position has none."""
    k = 4
    requests = rlinfer_world.greedy_requests(max_tokens=1, prompt_logprobs=True, prompt_top_logprobs=k)
    for c in rlinfer_world.generate(requests):
        prompt = list(c.prompt_token_ids)
        assert c.prompt_top_logprobs is not None and len(c.prompt_top_logprobs) == len(prompt)
        assert c.prompt_top_logprobs[0] is None
        want = rlinfer_world.oracle.prompt_top_logprobs(rlinfer_world.current, prompt, k)
        for got_row, want_row in zip(c.prompt_top_logprobs[1:], want, strict=True):
            assert got_row is not None and len(got_row) == k, got_row
            _assert_top_row(rlinfer_world, got_row, want_row)


def _assert_top_row(world: KitWorld, got_row: Mapping[int, float], want_row: Mapping[int, float]) -> None:
    """One position's alternatives: the oracle's top tokens with their logprobs; only a near-tie
    at the k-th place may change which token makes the cut."""
    floor = min(got_row.values())
    for token, value in want_row.items():
        if token in got_row:
            assert abs(got_row[token] - value) <= LOGPROB_TOLERANCE, (token, got_row, want_row)
        else:
            assert value <= floor + world.oracle.tie_tolerance, (token, got_row, want_row)


@pytest.mark.requires(Capability.STOP_STRINGS)
def test_stop_strings_are_honoured(rlinfer_world: KitWorld) -> None:
    tok = rlinfer_world.oracle.tokenizer
    full_requests = rlinfer_world.greedy_requests(max_tokens=16, ignore_eos=True)
    checked = 0
    for c in rlinfer_world.generate(full_requests):
        tokens = list(c.token_ids)
        text = tok.decode(tokens[4:], skip_special_tokens=True)
        stop = text.strip()[:2]
        if len(stop) < 2 or stop in tok.decode(tokens[:4], skip_special_tokens=True):
            continue
        request = GenerateRequest(
            prompt_token_ids=c.prompt_token_ids,
            sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=(stop,)),
        )
        (stopped,) = rlinfer_world.generate([request])
        assert stopped.finish_reason is FinishReason.STOP, (stop, stopped)
        assert stopped.stop_reason == stop
        assert list(stopped.token_ids) == tokens[: len(stopped.token_ids)]
        assert len(stopped.token_ids) < len(tokens)
        if stopped.text is not None:
            assert stop not in stopped.text, "the stop string is not part of the returned text"
        checked += 1
    assert checked >= 1, "no usable stop string found in the greedy outputs"


@pytest.mark.requires(Capability.BENCH)
@pytest.mark.hooks("rlinfer_bench_raw_generate")
def test_bench_raw_generate_counts_tokens(rlinfer_world: KitWorld) -> None:
    requests = rlinfer_world.greedy_requests(max_tokens=8, ignore_eos=True)
    produced = rlinfer_world.engine.bench_raw_generate(requests)
    assert produced == 8 * len(requests)
