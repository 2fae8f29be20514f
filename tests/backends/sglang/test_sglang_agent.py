"""Tool-call parsing and structured output on SGLang (rlinfer_sglang.agent).

Processed logprobs under a grammar are checked against an HF fp32 oracle with the grammar mask
computed independently by xgrammar's matcher (log_softmax over the allowed tokens, after the
temperature); the kit checks raw logprobs and that outputs hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch

from rlinfer_core.engine import Engine
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.tools import ToolSpec
from rlinfer_core.types import Capability, GenerateRequest, SamplingParams
from rlinfer_sglang.agent import parse, structured_params

TOL = 1e-5
ADD = ToolSpec(
    "add",
    "add two integers",
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
)
GOOD = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_each_call_segment_is_parsed_alone() -> None:
    unknown = '<tool_call>{"name": "zzz", "arguments": {}}</tool_call>'
    text = f"pre {GOOD} mid <tool_call>{{broken</tool_call>{unknown}{GOOD}"
    found = parse(text, "hermes", [ADD])
    assert [c.name for c in found.calls] == ["add", None, "zzz", "add"]
    assert found.calls[1].error and "JSON" in found.calls[1].error and found.calls[1].raw.endswith("</tool_call>")
    assert found.calls[2].error is None, "SGLang drops unknown tools; the facade marks them"
    assert found.content == "pre  mid"
    qwen = parse(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>{"a', "qwen", [ADD]
    )
    assert qwen.calls[0].arguments == {"a": 1, "b": 2} and qwen.calls[1].error
    llama = parse('{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama", [ADD])
    assert llama.calls[0].arguments == {"a": 1, "b": 2}
    assert structured_params(SamplingParams(structured={"choice": ["a.b", "c"]}).structured) == {"regex": r"(a\.b|c)"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("agent") / "m", seed=0)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[Engine]:
    eng = Engine.open("sglang", model=str(model), dtype="float32", seed=0, max_model_len=256)
    yield eng
    eng.shutdown()


def _masked_oracle(model: Path, prompt: list[int], tokens: list[int], regex: str, temperature: float) -> list[float]:
    """Processed logprobs of ``tokens``: HF logits, xgrammar's mask at each step, / T, log_softmax."""
    import xgrammar  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(model)), vocab_size=vocab)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_regex(regex))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :].double()
    out = []
    for i, token in enumerate(tokens):
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask)
        row = logits[i].clone().float()
        xgrammar.apply_token_bitmask_inplace(row.unsqueeze(0), bitmask)
        row = row.double() / (temperature or 1.0)
        out.append(float(torch.log_softmax(row, -1)[token]))
        if not matcher.accept_token(token):
            break  # EOS after the grammar ended
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_processed_logprobs_include_the_grammar_mask(engine: Engine, model: Path, temperature: float) -> None:
    assert Capability.STRUCTURED in engine.capabilities.supported
    regex = "(yes|no), [0-9]{1,3}"
    prompt = [1, 20, 30, 40]
    s = SamplingParams(temperature=temperature, max_tokens=16, structured={"regex": regex})
    (c,) = engine.generate([GenerateRequest(prompt_token_ids=prompt, sampling=s)])
    eos = set(engine.model_info.eos_token_ids) if engine.model_info else set()
    body = [t for t in c.token_ids if t not in eos]
    expected = _masked_oracle(model, prompt, list(c.token_ids), regex, temperature)
    assert len(expected) >= len(body) and body, (c.token_ids, expected)
    worst = max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=False))
    assert worst <= TOL, (worst, c.logprobs, expected)
    assert 0.0 in c.logprobs[: len(expected)], "a forced step has probability 1 under the mask"


def test_structured_stream_holds(engine: Engine) -> None:
    from transformers import AutoTokenizer

    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    s = SamplingParams(temperature=1.0, max_tokens=48, structured={"json_schema": schema})
    request = GenerateRequest(prompt_token_ids=[1, 20, 30, 40], sampling=s)
    eos = set(engine.model_info.eos_token_ids) if engine.model_info else set()
    ids = [t for d in engine.stream(request) for t in d.token_ids if t not in eos]
    tok = AutoTokenizer.from_pretrained(engine.config.model)
    text = tok.decode(ids, skip_special_tokens=True)
    assert request.sampling.structured is not None and request.sampling.structured.accepts(text), text
