"""The checkpoint layout both engines' fast-load tests build their model doubles for: a two-layer
Llama/Qwen2-shaped causal LM (q/k/v with biases, gate/up, a vocabulary of ``VOCAB`` rows), the rows
each checkpoint part takes in its fused parameter at tensor-parallel size 1 (vLLM's and SGLang's
weight loaders place them the same way), the layer doubles both engines' modules look like, and
parameter snapshots to compare loads with."""

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


def linear_shapes(layer: str = "model.layers.0") -> dict[str, tuple[int, ...]]:
    """The checkpoint shapes of one layer's linear weights (q/k/v, o, gate/up, down)."""
    return {
        f"{layer}.self_attn.q_proj.weight": (Q, HIDDEN),
        f"{layer}.self_attn.k_proj.weight": (KV, HIDDEN),
        f"{layer}.self_attn.v_proj.weight": (KV, HIDDEN),
        f"{layer}.self_attn.o_proj.weight": (HIDDEN, Q),
        f"{layer}.mlp.gate_proj.weight": (INTER, HIDDEN),
        f"{layer}.mlp.up_proj.weight": (INTER, HIDDEN),
        f"{layer}.mlp.down_proj.weight": (HIDDEN, INTER),
    }


def one_layer_shapes() -> dict[str, tuple[int, ...]]:
    """The checkpoint shapes of a one-layer model: embedding, the layer's linear weights and input
    norm, an untied head."""
    layer = "model.layers.0"
    return {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        **linear_shapes(layer),
        f"{layer}.input_layernorm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }


def param(*shape: int, fill: float = 0.0) -> Any:
    """A frozen parameter of ``shape`` filled with ``fill``."""
    return torch.nn.Parameter(torch.full(shape, fill), requires_grad=False)


class FusedLinearDouble(torch.nn.Module):
    """Stands in for QKVParallelLinear / MergedColumnParallelLinear: one weight, parts by rows."""

    def __init__(self, output_sizes: list[int], cols: int, bias: bool = False) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.weight = param(sum(output_sizes), cols)
        self.bias = param(sum(output_sizes)) if bias else None


class PlainDouble(torch.nn.Module):
    """Stands in for RowParallelLinear and RMSNorm (and, in vLLM's test, a padded embedding)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = param(*shape)


class LayerDouble(torch.nn.Module):
    """One decoder layer with the engines' fused modules; ``rotary``: the name and value of the
    rotary embedding's buffer (a buffer, never loaded)."""

    def __init__(self, rotary: tuple[str, Any]) -> None:
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = FusedLinearDouble([Q, KV, KV], HIDDEN, bias=True)
        self.self_attn.o_proj = PlainDouble(HIDDEN, Q)
        self.self_attn.rotary_emb = torch.nn.Module()
        self.self_attn.rotary_emb.register_buffer(*rotary)
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = FusedLinearDouble([INTER, INTER], HIDDEN)
        self.mlp.down_proj = PlainDouble(HIDDEN, INTER)
        self.input_layernorm = PlainDouble(HIDDEN)


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


def reference_load(model: Any, name: str, tensor: Any) -> None:
    """The test oracle: what vLLM's and SGLang's weight loaders do with one checkpoint tensor (TP 1,
    unquantized, CUDA), from offsets spelled out by hand: a fused part into its rows, the vocabulary
    into its first ``VOCAB`` rows with the padding rows zeroed, the head of a tied model skipped
    (vLLM's ``skip_prefixes``, SGLang's Llama; Qwen2/3 find no such parameter), the rest whole."""
    path, _, attr = name.rpartition(".")
    parent, _, leaf = path.rpartition(".")
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return
    if leaf in FUSED:
        start, stop = ROWS[leaf]
        getattr(model.get_submodule(f"{parent}.{FUSED[leaf]}"), attr).data[start:stop].copy_(tensor)
    elif leaf in ("embed_tokens", "lm_head"):
        weight = model.get_submodule(path).weight.data
        weight[:VOCAB].copy_(tensor)
        weight[VOCAB:].fill_(0)
    else:
        getattr(model.get_submodule(path), attr).data.copy_(tensor)


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


class Fp8LinearDouble(torch.nn.Module):
    """Stands in for a linear layer after an engine's online FP8 processing (TP 1): ``weight`` the
    transpose of contiguous E4M3 codes ``[out, in]``, a float32 ``weight_scale`` of ``scale_shape``
    (``(1,)`` per tensor as vLLM, ``(1, out)`` per output channel as SGLang on cutlass), the parts'
    rows in ``logical_widths``, no input scale."""

    def __init__(self, widths: list[int], cols: int, scale_shape: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        self.logical_widths = widths
        self.output_sizes = widths
        self.output_size_per_partition, self.input_size_per_partition = sum(widths), cols
        self.orig_dtype = torch.bfloat16
        codes = torch.zeros(sum(widths), cols, dtype=torch.float8_e4m3fn)
        self.weight = torch.nn.Parameter(codes.t(), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.ones(scale_shape), requires_grad=False)
        self.input_scale = None


def fp8_quant_double(layer: Any, merged: Any) -> None:
    """A torch stand-in for an engine's FP8 quantization op (the ops do not run on CPU): amax / 448
    per output row where the layer's scale has one per row, else per tensor, the codes written into
    ``layer.codes`` and the scale into ``layer.scale``."""
    per_row = layer.scale.numel() > 1
    amax = merged.float().abs().amax(dim=1, keepdim=True) if per_row else merged.float().abs().max()
    scale = amax / 448.0
    layer.codes.copy_((merged.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
    layer.scale.copy_(scale.reshape(layer.scale.shape))
