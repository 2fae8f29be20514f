"""The checkpoint layout both engines' fast-load tests build their model doubles for: a two-layer
Llama/Qwen2-shaped causal LM (q/k/v with biases, gate/up, a vocabulary of ``VOCAB`` rows), the rows
each checkpoint part takes in its fused parameter at tensor-parallel size 1 (vLLM's and SGLang's
weight loaders place them the same way), and parameter snapshots to compare loads with."""

from __future__ import annotations

from typing import Any

import torch

HIDDEN, HEADS_Q, HEADS_KV, HEAD, INTER, VOCAB = 8, 4, 2, 2, 12, 10
Q, KV = HEADS_Q * HEAD, HEADS_KV * HEAD

#: rows of each part in its fused parameter
ROWS = {"q_proj": (0, Q), "k_proj": (Q, Q + KV), "v_proj": (Q + KV, Q + 2 * KV), "gate_proj": (0, INTER)}
ROWS["up_proj"] = (INTER, 2 * INTER)
#: the fused parameter's module name of each part
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
FUSED["up_proj"] = "gate_up_proj"


def checkpoint_shapes(tied: bool) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of the checkpoint (no ``lm_head.weight`` when ``tied``)."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(2):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.self_attn.q_proj.weight": (Q, HIDDEN),
            f"{p}.self_attn.k_proj.weight": (KV, HIDDEN),
            f"{p}.self_attn.v_proj.weight": (KV, HIDDEN),
            f"{p}.self_attn.q_proj.bias": (Q,),
            f"{p}.self_attn.k_proj.bias": (KV,),
            f"{p}.self_attn.v_proj.bias": (KV,),
            f"{p}.self_attn.o_proj.weight": (HIDDEN, Q),
            f"{p}.mlp.gate_proj.weight": (INTER, HIDDEN),
            f"{p}.mlp.up_proj.weight": (INTER, HIDDEN),
            f"{p}.mlp.down_proj.weight": (HIDDEN, INTER),
            f"{p}.input_layernorm.weight": (HIDDEN,),
        }
    if not tied:
        out["lm_head.weight"] = (VOCAB, HIDDEN)
    return out


def random_update(shapes: dict[str, tuple[int, ...]], seed: int) -> list[tuple[str, Any]]:
    """Random float32 tensors of ``shapes``, reproducible by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=gen)) for name, shape in shapes.items()]


def snapshot(model: Any) -> dict[str, Any]:
    """Copies of the model's parameters by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_unchanged(model: Any, before: dict[str, Any]) -> None:
    """The model's parameters equal ``before`` (a :func:`snapshot`)."""
    now = snapshot(model)
    assert now.keys() == before.keys()
    for name in now:
        assert torch.equal(now[name], before[name]), name


def assert_same_params(a: Any, b: Any) -> None:
    """Two models hold equal parameters under the same names."""
    assert_unchanged(a, snapshot(b))
