"""The engine-agnostic part of the fast FP8 refit (rlinfer_core.transfer.fp8_fast_load): a layer's
parts and their checks, the routing of an update (whole layers only), the merged BF16 input, and
Fp8FastLoader's all-or-nothing load, over a plan built here by hand with the layer doubles of
``causal_lm_layout`` and ``fp8_quant_double`` for the engine's op (the engines' plans and ops:
tests/backends/vllm/test_fp8_load.py, tests/backends/sglang/test_sglang_fp8_load.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from causal_lm_layout import (  # noqa: E402
    HIDDEN,
    INTER,
    KV,
    VOCAB,
    Fp8LinearDouble,
    PlainDouble,
    Q,
    fp8_quant_double,
    one_layer_shapes,
    snapshot,
)

from rlinfer_core.errors import WeightUpdateError  # noqa: E402
from rlinfer_core.transfer.fp8_fast_load import (  # noqa: E402
    Fp8FastLoader,
    Fp8Plan,
    fp8_layer,
    make_plan,
    merged_input,
    route,
)

BF16 = torch.bfloat16
P = "model.layers.0"
PADDED = VOCAB + 6  # the embedding's rows in the engine: the checkpoint's VOCAB, then padding
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SHAPES = one_layer_shapes()
SPECS = {name: (BF16, shape) for name, shape in SHAPES.items()}


class Fp8ModelDouble(torch.nn.Module):
    """One decoder layer of FP8 linears (per-channel scales), a BF16 norm, a padded embedding."""

    def __init__(self) -> None:
        super().__init__()
        scale = {"qkv_proj": Q + 2 * KV, "o_proj": HIDDEN, "gate_up_proj": 2 * INTER, "down_proj": HIDDEN}
        self.model = torch.nn.Module()
        self.model.embed_tokens = PlainDouble(PADDED, HIDDEN)
        self.model.embed_tokens.weight.data = torch.full((PADDED, HIDDEN), 0.5, dtype=BF16)
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = Fp8LinearDouble([Q, KV, KV], HIDDEN, (1, scale["qkv_proj"]))
        layer.self_attn.o_proj = Fp8LinearDouble([HIDDEN], Q, (1, scale["o_proj"]))
        layer.mlp = torch.nn.Module()
        layer.mlp.gate_up_proj = Fp8LinearDouble([INTER, INTER], HIDDEN, (1, scale["gate_up_proj"]))
        layer.mlp.down_proj = Fp8LinearDouble([HIDDEN], INTER, (1, scale["down_proj"]))
        layer.input_layernorm = PlainDouble(HIDDEN)
        layer.input_layernorm.weight.data = torch.zeros(HIDDEN, dtype=BF16)
        self.model.layers = torch.nn.ModuleList([layer])


def plan_of(model: Any, specs: Any = SPECS) -> Fp8Plan:
    """What an engine's half builds: the FP8 layers with their parts, the plain slices, the padding."""
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8LinearDouble):
            leaf = name.rpartition(".")[2]
            codes, cols = module.weight.t(), module.input_size_per_partition
            parts = PARTS.get(leaf, (leaf,))
            layers.append(fp8_layer(name, parts, module.logical_widths, cols, codes, module.weight_scale, None, specs))
    embed, norm = model.model.embed_tokens.weight, model.get_parameter(f"{P}.input_layernorm.weight")
    views = {"model.embed_tokens.weight": embed[:VOCAB], f"{P}.input_layernorm.weight": norm}
    return make_plan(layers, views, frozenset({"lm_head.weight"}), {"model.embed_tokens.weight": embed[VOCAB:]})


def update(seed: int) -> list[tuple[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=gen).to(BF16)) for name, shape in SHAPES.items()]


def test_fp8_layer_names_its_parts_in_row_order_and_checks_them() -> None:
    codes, scale = torch.zeros(Q + 2 * KV, HIDDEN), torch.ones(1)
    layer = fp8_layer(f"{P}.self_attn.qkv_proj", PARTS["qkv_proj"], [Q, KV, KV], HIDDEN, codes, scale, None, SPECS)
    assert layer.parts == tuple(f"{P}.self_attn.{x}_proj.weight" for x in "qkv") and layer.rows == (Q, KV, KV)
    assert layer.dtype == BF16  # the first part's dtype in the specs
    with pytest.raises(ValueError, match="logical_widths"):
        fp8_layer(f"{P}.self_attn.qkv_proj", PARTS["qkv_proj"], [Q, KV], HIDDEN, codes, scale, BF16)
    with pytest.raises(ValueError, match="logical_widths"):
        fp8_layer(f"{P}.self_attn.qkv_proj", PARTS["qkv_proj"], [Q, KV, KV + 1], HIDDEN, codes, scale, BF16)
    wrong = {**SPECS, f"{P}.self_attn.k_proj.weight": (BF16, (KV + 1, HIDDEN))}
    with pytest.raises(ValueError, match="k_proj"):
        fp8_layer(f"{P}.self_attn.qkv_proj", PARTS["qkv_proj"], [Q, KV, KV], HIDDEN, codes, scale, None, wrong)


def test_plan_gives_fp8_parts_no_plain_slice() -> None:
    plan = plan_of(Fp8ModelDouble())
    assert len(plan.layers) == 4 and set(plan.by_part) | set(plan.views) | plan.skipped == set(SPECS)
    views = {**plan.views, f"{P}.mlp.down_proj.weight": torch.zeros(HIDDEN, INTER)}  # e.g. a square FP8 weight
    again = make_plan(plan.layers, views, plan.skipped, {"not.a.view": torch.zeros(1)})
    assert f"{P}.mlp.down_proj.weight" not in again.views and not again.zeroed


def test_route_takes_whole_layers_only() -> None:
    plan = plan_of(Fp8ModelDouble())
    copies, layers = route(plan, update(0))  # type: ignore[misc]
    assert len(copies) == 2 and sorted(len(parts) for _, parts in layers) == [1, 1, 2, 3]
    no_v = [(n, t) for n, t in update(0) if "v_proj" not in n]
    assert "partial update (no model.layers.0.self_attn.v_proj.weight)" in str(route(plan, no_v))
    short = [(n, t[:-1] if "k_proj" in n else t) for n, t in update(0)]
    assert "parts of shapes" in str(route(plan, short))
    as_float = [(n, t.float() if "layernorm" in n else t) for n, t in update(0)]
    assert "layernorm" in str(route(plan, as_float))
    assert "no parameter slice" in str(route(plan, [*update(0), ("model.norm.weight", torch.zeros(HIDDEN))]))
    mlp_only = [(n, t) for n, t in update(0) if ".mlp." in n]
    assert not isinstance(route(plan, mlp_only), str)


def test_merged_input_stacks_parts_and_casts_like_a_loader() -> None:
    layer = next(layer for layer in plan_of(Fp8ModelDouble()).layers if len(layer.parts) == 3)
    q, k, v = (torch.randn(r, HIDDEN) for r in (Q, KV, KV))
    scratch = torch.full((4 * Q * HIDDEN,), float("nan"), dtype=BF16)
    merged = merged_input(layer, [q, k, v], scratch)
    assert merged.data_ptr() == scratch.data_ptr() and torch.equal(merged, torch.cat([q, k, v]).to(BF16))
    lone = next(layer for layer in plan_of(Fp8ModelDouble()).layers if layer.module.endswith("o_proj"))
    sent = torch.randn(HIDDEN, Q, dtype=BF16)
    assert merged_input(lone, [sent], scratch) is sent
    transposed = sent.t().contiguous().t()
    assert torch.equal(merged_input(lone, [transposed], scratch), sent)


def loader_for(model: Any, quantize: Any = fp8_quant_double) -> Fp8FastLoader:
    return Fp8FastLoader(
        lambda: model, plan_of, quantize, engine="TestEngine", fallback="its own path", logger=logging.getLogger("t")
    )


def test_load_quantizes_whole_layers_into_the_live_codes_and_copies_the_rest() -> None:
    model = Fp8ModelDouble()
    layer = model.model.layers[0]
    codes_ptr = layer.self_attn.qkv_proj.weight.data_ptr()
    sent = update(1)
    given = dict(sent)
    assert loader_for(model).load(sent)
    merged = torch.cat([given[f"{P}.self_attn.{x}_proj.weight"] for x in "qkv"])
    expected = type("Expected", (), {})()
    expected.codes = torch.empty(merged.shape, dtype=torch.float8_e4m3fn)
    expected.scale = torch.empty(1, Q + 2 * KV)
    fp8_quant_double(expected, merged)
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.data_ptr() == codes_ptr, "written in place (captured graphs keep their addresses)"
    assert torch.equal(qkv.weight.t().view(torch.uint8), expected.codes.view(torch.uint8))
    assert torch.equal(qkv.weight_scale, expected.scale)
    assert torch.equal(layer.input_layernorm.weight, given[f"{P}.input_layernorm.weight"])
    embed = model.model.embed_tokens.weight
    assert torch.equal(embed[:VOCAB], given["model.embed_tokens.weight"]) and not embed[VOCAB:].any()


def _bytes(tensor: Any) -> Any:
    return tensor.contiguous().view(torch.uint8)


def test_load_writes_nothing_for_an_update_that_does_not_qualify(caplog: pytest.LogCaptureFixture) -> None:
    model = Fp8ModelDouble()
    before = snapshot(model)
    loader = loader_for(model)
    partial = [(n, t) for n, t in update(2) if "up_proj" not in n]
    with caplog.at_level(logging.INFO, logger="t"):
        assert not loader.load(partial) and not loader.load(partial)
    for name, now in snapshot(model).items():
        assert torch.equal(_bytes(now), _bytes(before[name])), name
    notes = [r.getMessage() for r in caplog.records if "fast FP8 load not used" in r.getMessage()]
    assert len(notes) == 1 and "partial update" in notes[0] and "its own path instead" in notes[0]


def test_no_plan_means_the_engines_path_and_a_failing_op_a_typed_error() -> None:
    def no_plan(model: Any) -> Fp8Plan:
        raise ValueError("a layout it does not know")

    model = Fp8ModelDouble()
    loader = Fp8FastLoader(
        lambda: model, no_plan, fp8_quant_double, engine="E", fallback="f", logger=logging.getLogger("t")
    )
    assert not loader.load(update(3))

    def broken(layer: Any, merged: Any) -> None:
        raise RuntimeError("kernel fault")

    with pytest.raises(WeightUpdateError, match="TestEngine failed during a fast FP8 load"):
        loader_for(model, broken).load(update(3))
