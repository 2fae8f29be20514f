"""Shared helpers of the vLLM backend tests: tiny models, an HF greedy oracle, engine config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: small and bounded, like the conformance kit's engine
ENGINE_FIELDS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 16,
    "seed": 0,
    "request_timeout_s": 120.0,
    "startup_timeout_s": 600.0,
}

PROMPTS: list[list[int]] = [[5, 6, 7, 10], [40, 41, 42], [9]]


def state_dict(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's tensors by HF name."""
    from rlinfer_core.transfer.disk import read_tensors

    return {name: t.clone() for name, t in read_tensors(model_dir)}


def hf_greedy(
    model_dir: Path, weights: Mapping[str, Any], prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy continuations by HF transformers with ``weights`` loaded into the model's architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # the embedding, loaded
    assert not unexpected and all("rotary" in m or m in tied for m in missing), (missing, unexpected)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out
