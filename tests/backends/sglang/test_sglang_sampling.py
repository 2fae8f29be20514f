"""Sampling processors and logprob modes on SGLang against an HF fp32 oracle (1e-5), on one engine.

The oracle follows LogprobsMode's definition: raw logits -> repetition penalty (prompt + generated)
-> presence/frequency (generated) -> logit_bias, allowed ids -> temperature -> top_k, top_p, min_p
-> log_softmax over the survivors; raw mode is log_softmax of the raw logits. Each case sets one
processor, so the order of two processors never decides a case.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch

from rlinfer_core.engine import Engine
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import Capability, GenerateRequest, LogprobsMode, SamplingParams

TOL = 1e-5
PROMPT = [1, 20, 30, 40, 20, 30]
BASE: dict[str, Any] = {"max_tokens": 12, "ignore_eos": True, "logprobs": 3}

CASES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.7},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "top_k": {"temperature": 0.8, "top_k": 5},
    "top_k_1": {"temperature": 0.8, "top_k": 1},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
    "repetition_greedy": {"temperature": 0.0, "repetition_penalty": 1.3},
    "repetition_below_1": {"temperature": 0.9, "repetition_penalty": 0.7},
    "presence_frequency": {"temperature": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    "logit_bias": {"temperature": 0.9, "logit_bias": {5: 3.0, 7: -2.0, 20: 1.5}},
    "allowed_token_ids": {"temperature": 0.9, "allowed_token_ids": [5, 6, 7, 8, 9, 20]},
    "raw": {"temperature": 0.9, "logprobs_mode": "raw"},
    "raw_truncated_penalised": {"temperature": 0.9, "top_p": 0.8, "repetition_penalty": 1.2, "logprobs_mode": "raw"},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sampling") / "m", seed=0)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[Engine]:
    eng = Engine.open("sglang", model=str(model), dtype="float32", seed=0, max_model_len=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()


def _oracle(logits: torch.Tensor, generated: list[int], s: SamplingParams) -> torch.Tensor:
    """Logprobs (float64, full vocabulary) of one position, given the tokens generated before it."""
    row = logits.double().clone()
    if s.logprobs_mode is LogprobsMode.RAW:
        return torch.log_softmax(row, -1)
    if s.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(PROMPT) | set(generated)))
        v = row[seen]
        row[seen] = torch.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
    for token, count in Counter(generated).items():
        row[token] -= s.presence_penalty + s.frequency_penalty * count
    for token, bias in s.logit_bias:
        row[token] += bias
    if s.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[list(s.allowed_token_ids)] = True
        row = row.masked_fill(~keep, float("-inf"))
    if s.greedy:
        return torch.log_softmax(row, -1)
    row = row / s.temperature
    probs = torch.softmax(row, -1)
    if s.top_k > 0:
        row = row.masked_fill(row < torch.topk(row, s.top_k).values[-1], float("-inf"))
    if s.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = before > s.top_p
        row = row.masked_fill(drop, float("-inf"))
    if s.min_p > 0.0:
        row = row.masked_fill(probs < s.min_p * probs.max(), float("-inf"))
    return torch.log_softmax(row, -1)


def _deltas(hf: Any, tokens: list[int], s: SamplingParams, logprobs: Any, top: Any) -> tuple[float, float]:
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    worst, worst_top = 0.0, 0.0
    for i, token in enumerate(tokens):
        ref = _oracle(logits[i], tokens[:i], s)
        worst = max(worst, abs(logprobs[i] - float(ref[token])))
        for t, lp in (top[i] if top else {}).items():
            worst_top = max(worst_top, abs(lp - float(ref[t])))
        if top and not s.greedy:
            best = torch.topk(ref, min(s.logprobs, int(torch.isfinite(ref).sum()))).indices.tolist()
            assert set(top[i]) == set(best), f"top logprobs are the oracle's top {s.logprobs} at {i}"
    return worst, worst_top


def test_new_capabilities_are_claimed(engine: Engine) -> None:
    for capability in (
        Capability.SAMPLING_MIN_P,
        Capability.SAMPLING_PENALTIES,
        Capability.SAMPLING_LOGIT_BIAS,
        Capability.LOGPROBS_RAW,
        Capability.LOGPROBS_PROCESSED,
        Capability.WEIGHTS_CHECKSUM,
    ):
        assert engine.capabilities.supports(capability), capability


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_equal_the_oracle(engine: Engine, hf: Any, case: str) -> None:
    s = SamplingParams(**{**BASE, **CASES[case]})
    (c,) = engine.generate(GenerateRequest(prompt_token_ids=PROMPT, sampling=s))
    tokens = list(c.token_ids)
    assert len(tokens) == s.max_tokens
    if s.allowed_token_ids is not None:
        assert set(tokens) <= set(s.allowed_token_ids)
    worst, worst_top = _deltas(hf, tokens, s, c.logprobs, c.top_logprobs)
    print(f"{case}: max |dlogprob| {worst:.2e}, top {worst_top:.2e}")
    assert worst < TOL and worst_top < TOL


@pytest.mark.parametrize("case", ["top_p", "repetition_below_1", "raw"])
def test_stream_equals_the_oracle(engine: Engine, hf: Any, case: str) -> None:
    s = SamplingParams(**{**BASE, **CASES[case], "logprobs": 0})
    deltas = list(engine.stream(GenerateRequest(prompt_token_ids=PROMPT, sampling=s)))
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert all(d.token_versions == (0,) * len(d.token_ids) for d in deltas)
    assert _deltas(hf, tokens, s, logprobs, None)[0] < TOL
