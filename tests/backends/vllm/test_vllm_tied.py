"""A tied output head (Qwen2 ties lm_head to the embedding) follows every weight update.

vLLM on CPU multiplies by a repacked copy of the head made when weights are processed; its
layer-wise reload loads the tied tensor through the embedding only and never repacked the head,
so the engine kept sampling from the old head (max |Δlogprob| 0.78 against HF). One engine,
teacher-forced HF logprobs in float32, after updates over three transports, plus the weight
checksums and per-token versions across pause(keep) + update + resume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_test_helpers import PROMPTS, state_dict

from rlinfer_core.engine import Engine
from rlinfer_core.transfer.buckets import pack
from rlinfer_core.types import Capability, GenerateRequest, PauseMode, SamplingParams
from rlinfer_core.weights import Buckets, CheckpointDir, NamedTensors

TOL = 1e-5
MAX_TOKENS = 8


@pytest.fixture
def models(qwen2_models: tuple[Path, Path]) -> tuple[Path, Path]:
    return qwen2_models


@pytest.fixture
def engine(qwen2_engine: Engine) -> Engine:
    return qwen2_engine


def hf_logprobs(
    model_dir: Path, weights: Mapping[str, Any], prompt: Sequence[int], tokens: Sequence[int]
) -> list[float]:
    """Teacher-forced log_softmax of ``tokens`` after ``prompt`` by HF transformers (float32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dict(weights), strict=False)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    ids = list(prompt) + list(tokens)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def max_delta(engine: Engine, model_dir: Path, weights: Mapping[str, Any]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=params) for p in PROMPTS])
    worst = 0.0
    for prompt, completion in zip(PROMPTS, out, strict=True):
        reference = hf_logprobs(model_dir, weights, prompt, completion.token_ids)
        worst = max(worst, *(abs(a - b) for a, b in zip(reference, completion.logprobs, strict=True)))
    return worst


def test_model_is_tied(engine: Engine, models: tuple[Path, Path]) -> None:
    assert "lm_head.weight" not in state_dict(models[0])
    assert engine.model_info is not None
    assert engine.model_info.tied_weights == {"lm_head.weight": "model.embed_tokens.weight"}
    assert max_delta(engine, models[0], state_dict(models[0])) < TOL
    assert engine.verify_weights(state_dict(models[0])).ok


@pytest.mark.parametrize("transport", ["tensors", "buckets", "disk"])
def test_update_reaches_tied_head(engine: Engine, models: tuple[Path, Path], transport: str) -> None:
    base, other = state_dict(models[0]), state_dict(models[1])
    # the HF oracle distinguishes the two heads: a stale head is far off
    stale = dict(other, **{"lm_head.weight": base["model.embed_tokens.weight"]})
    for target, weights in ((models[1], other), (models[0], base)):
        if transport == "tensors":
            engine.update_weights(NamedTensors.of(weights))
        elif transport == "buckets":
            engine.update_weights(Buckets(pack(weights.items())))
        else:
            engine.update_weights(CheckpointDir(str(target)))
        assert max_delta(engine, models[0], weights) < TOL
        assert engine.verify_weights(weights).ok
    assert not engine.verify_weights(stale).ok  # the served head is the base one now, not seed 1's


def test_checksum_detects_wrong_head(engine: Engine, models: tuple[Path, Path]) -> None:
    assert engine.capabilities.supports(Capability.WEIGHTS_CHECKSUM)
    base, other = state_dict(models[0]), state_dict(models[1])
    served = engine.weights_checksum()
    assert set(served) == set(base) | {"lm_head.weight"}
    wrong = engine.verify_weights({"lm_head.weight": other["model.embed_tokens.weight"]})
    assert wrong.mismatched == ("lm_head.weight",)


def test_token_versions_across_pause_keep_update(engine: Engine, models: tuple[Path, Path]) -> None:
    before = engine.weight_version
    request = GenerateRequest(
        prompt_token_ids=PROMPTS[0], sampling=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    versions: list[int] = []
    stream = engine.stream(request)
    for delta in stream:
        assert delta.token_versions is not None
        versions.extend(delta.token_versions)
        if len(versions) >= 2:
            break
    engine.pause(PauseMode.KEEP)
    frozen = len(versions)
    new = engine.update_weights(NamedTensors.of(state_dict(models[1])))
    engine.resume()
    for delta in stream:
        assert delta.token_versions is not None
        versions.extend(delta.token_versions)
    assert len(versions) == 24
    assert versions[:frozen] == [before] * frozen
    # tokens already on their way when pause returned carry the old version, every later one the new
    switch = versions.index(new)
    assert switch >= frozen and versions[switch:] == [new] * (24 - switch)
    assert set(versions[:switch]) == {before}
    engine.update_weights(NamedTensors.of(state_dict(models[0])))
