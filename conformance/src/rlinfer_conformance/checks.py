"""Contract checks shared by the suite: what every completion of a valid request must satisfy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlinfer_core.types import Completion, FinishReason, GenerateRequest

if TYPE_CHECKING:
    from rlinfer_conformance.world import KitWorld

#: a sampled token's logprob may exceed 0 only by rounding
LOGPROB_EPS = 1e-6


def check_batch(world: KitWorld, requests: Sequence[GenerateRequest], completions: Sequence[Completion]) -> None:
    """``n`` completions per request, in request order then index, each meeting the contract."""
    expected = [(r.request_id, i) for r in requests for i in range(r.sampling.n)]
    got = [(c.request_id, c.index) for c in completions]
    assert got == expected, f"completions must come in request order then index: {got} != {expected}"
    by_id = {r.request_id: r for r in requests}
    for c in completions:
        check_completion(world, by_id[c.request_id], c)


def check_completion(world: KitWorld, request: GenerateRequest, c: Completion) -> None:
    """Lengths, ids, logprobs, finish and stop reasons of one completion."""
    s = request.sampling
    tokens = list(c.token_ids)
    where = f"{request.request_id}[{c.index}] ({s}) -> {tokens} {c.finish_reason} {c.stop_reason!r}"
    if request.prompt_token_ids is not None:
        assert c.prompt_token_ids == request.prompt_token_ids, where
    assert len(c.logprobs) == len(tokens), f"one logprob per token: {where}"
    assert all(0 <= t < world.vocab_size for t in tokens), f"token ids must lie in the vocabulary: {where}"
    assert all(math.isfinite(x) and x <= LOGPROB_EPS for x in c.logprobs), f"logprobs finite, <= 0: {c.logprobs}"
    assert isinstance(c.finish_reason, FinishReason), where
    if c.finish_reason is FinishReason.ABORT:
        assert len(tokens) <= s.max_tokens, where
        return
    at_context = len(c.prompt_token_ids) + len(tokens) >= world.max_model_len
    assert 1 <= len(tokens) <= s.max_tokens, f"1 <= len <= max_tokens: {where}"
    assert len(tokens) >= s.min_tokens or at_context, f"len >= min_tokens: {where}"
    stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(world.eos_ids))
    assert not stops.intersection(tokens[:-1]), f"generation must end at the first stop/EOS token: {where}"
    if c.finish_reason is FinishReason.LENGTH:
        assert len(tokens) == s.max_tokens or at_context, f"'length' only at max_tokens or context: {where}"
    else:
        assert c.finish_reason is FinishReason.STOP, where
        if isinstance(c.stop_reason, str):
            assert c.stop_reason in s.stop or c.stop_reason in s.stop_regex, f"stop string not requested: {where}"
        else:
            assert tokens[-1] in stops, f"'stop' must end with EOS or a stop token id: {where}"
            if c.stop_reason is not None:
                assert c.stop_reason == tokens[-1], f"stop_reason must be the stop token: {where}"
    if len(tokens) < s.max_tokens and not at_context:
        assert c.finish_reason is FinishReason.STOP, f"short of max_tokens needs a stop: {where}"


def parity_applies(request: GenerateRequest) -> bool:
    """The oracle reproduces the sampling distribution except under min_tokens (an EOS mask the
    oracle does not model); truncation (top_p, top_k, min_p) is modelled."""
    return request.sampling.min_tokens == 0
