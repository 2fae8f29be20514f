"""The on-the-fly tiny model: deterministic from its seed, loadable by HF, with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.transfer.disk import read_tensors


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "a": make_tiny_model(root / "a", seed=0),
        "a2": make_tiny_model(root / "a2", seed=0),
        "b": make_tiny_model(root / "b", seed=1),
    }


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(read_tensors(path))


def test_same_seed_gives_identical_tensors(models: dict[str, Path]) -> None:
    a, a2 = _weights(models["a"]), _weights(models["a2"])
    assert set(a) == set(a2) and len(a) > 5
    for name in a:
        assert torch.equal(a[name], a2[name]), name
    assert (models["a"] / "tokenizer.json").read_text() == (models["a2"] / "tokenizer.json").read_text()


def test_different_seed_gives_different_weights_same_shapes(models: dict[str, Path]) -> None:
    a, b = _weights(models["a"]), _weights(models["b"])
    assert {n: t.shape for n, t in a.items()} == {n: t.shape for n, t in b.items()}
    differing = [n for n in a if not torch.equal(a[n], b[n])]
    # every randomly initialised matrix differs (norm weights are all ones in both)
    assert all(n in differing for n in a if a[n].dim() == 2)
    assert (models["a"] / "tokenizer.json").read_text() == (models["b"] / "tokenizer.json").read_text()


def test_config_head_dim_and_metadata(models: dict[str, Path]) -> None:
    config = json.loads((models["a"] / "config.json").read_text())
    assert config["head_dim"] == 64
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    meta = json.loads((models["b"] / "rlinfer_tiny_model.json").read_text())
    assert meta["seed"] == 1


def test_hf_loads_model_and_tokenizer_with_chat_template(models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["a"])
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>hello<|end|><|assistant|>"
    ids = tok("The quick brown fox")["input_ids"]
    assert tok.decode(ids) == "The quick brown fox"
    model = AutoModelForCausalLM.from_pretrained(models["a"])
    assert model.config.vocab_size >= len(tok)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # the loaded weights are the ones on disk
    on_disk = _weights(models["a"])
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), on_disk[name]), name
