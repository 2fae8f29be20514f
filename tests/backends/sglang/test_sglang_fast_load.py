"""Fast in-place weight loading in SGLang's scheduler (rlinfer_sglang.scheduler.fast_load): the slices
found, the batched copy against SGLang's weight loaders, the eligibility decision.

The unit tests run on CPU over ``CausalLMDouble``, a small torch module built here with the layout
SGLang's CUDA layers give Llama/Qwen2 at TP 1 (``qkv_proj``/``gate_up_proj`` with ``output_sizes``,
an embedding and head padded past ``org_vocab_size``, a tied head that is the embedding module, a
rotary buffer; layers and layout from ``causal_lm_layout``). Its oracle, ``causal_lm_layout.reference_load``,
writes each checkpoint tensor the way SGLang's
weight loaders do (``QKVParallelLinear``/``MergedColumnParallelLinear.weight_loader`` rows,
``VocabParallelEmbedding.weight_loader``'s copy and zero-filled padding), from offsets spelled out
by hand. That the real engine on CPU keeps ``load_weights`` is tested in test_sglang_weights.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from causal_lm_layout import (  # noqa: E402
    HEAD,
    HIDDEN,
    INTER,
    KV,
    VOCAB,
    LayerDouble,
    PlainDouble,
    assert_same_params,
    checkpoint_shapes,
    param,
    random_update,
    reference_load,
    snapshot,
)

from rlinfer_core.transfer.fast_load import FastLoader  # noqa: E402
from rlinfer_sglang.scheduler import fast_load  # noqa: E402
from rlinfer_sglang.scheduler.fast_load import ineligible_reason, parameter_views  # noqa: E402

PADDED = 64  # the vocabulary rows of the engine's embedding (VOCAB in the checkpoint)


class VocabDouble(torch.nn.Module):
    """Stands in for VocabParallelEmbedding / ParallelLMHead: padded rows past ``org_vocab_size``
    (non-zero here, as after a dummy load, so that the zero-filling is seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.org_vocab_size = VOCAB
        self.weight = param(PADDED, HIDDEN, fill=0.5)


class CausalLMDouble(torch.nn.Module):
    """Two layers; ``tied``: ``lm_head`` is the embedding module (as SGLang's Llama and Qwen2 do)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = VocabDouble()
        self.model.layers = torch.nn.ModuleList(
            [LayerDouble(("cos_sin_cache", torch.ones(4, HEAD))), LayerDouble(("cos_sin_cache", torch.ones(4, HEAD)))]
        )
        self.model.norm = PlainDouble(HIDDEN)
        self.lm_head = self.model.embed_tokens if tied else VocabDouble()
        self.config = SimpleNamespace(tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
def test_every_checkpoint_tensor_has_a_parameter_slice(tied: bool) -> None:
    model = CausalLMDouble(tied)
    plan = parameter_views(model)
    assert set(plan.views) == set(checkpoint_shapes(tied))
    assert plan.skipped == (frozenset({"lm_head.weight"}) if tied else frozenset())
    assert set(plan.zeroed) == {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})


@pytest.mark.parametrize("tied", [False, True])
def test_fast_load_matches_the_weight_loaders(tied: bool) -> None:
    fast_model, reference = CausalLMDouble(tied), CausalLMDouble(tied)
    shapes = checkpoint_shapes(tied)
    loader = FastLoader(lambda: fast_model, parameter_views)
    for seed in (1, 2):
        update = random_update(shapes, seed)
        if tied:  # a tied checkpoint that lists the head anyway: skipped as load_weights does
            update.append(("lm_head.weight", torch.randn(VOCAB, HIDDEN)))
        assert loader.load(update)
        for name, tensor in update:
            reference_load(reference, name, tensor)
        assert_same_params(fast_model, reference)
    assert torch.count_nonzero(fast_model.model.embed_tokens.weight[VOCAB:]) == 0  # padding zero-filled
    if tied:  # the head reads the embedding's tensor: the update reached it
        assert torch.equal(fast_model.lm_head.weight[:VOCAB], update[0][1])


def test_partial_update_of_one_fused_part_writes_only_its_rows() -> None:
    model, reference = CausalLMDouble(tied=False), CausalLMDouble(tied=False)
    loader = FastLoader(lambda: model, parameter_views)
    k = torch.full((KV, HIDDEN), 3.0)
    assert loader.load([("model.layers.1.self_attn.k_proj.weight", k)])
    reference_load(reference, "model.layers.1.self_attn.k_proj.weight", k)
    assert_same_params(model, reference)
    assert torch.count_nonzero(model.model.embed_tokens.weight[VOCAB:]) > 0  # not written: not zeroed


@pytest.mark.parametrize(
    "bad",
    [
        ("model.layers.0.self_attn.rotary_emb.cos_sin_cache", torch.ones(4, HEAD)),  # a buffer
        ("model.layers.9.mlp.up_proj.weight", torch.ones(INTER, HIDDEN)),  # no such module
        ("model.layers.0.mlp.gate_up_proj.weight", torch.ones(2 * INTER, HIDDEN)),  # fused in the checkpoint
        ("model.norm.weight", torch.ones(HIDDEN, dtype=torch.float64)),  # another dtype (load_weights casts)
        ("model.embed_tokens.weight", torch.ones(PADDED, HIDDEN)),  # another shape
    ],
    ids=["buffer", "unknown", "prefused", "dtype", "shape"],
)
def test_one_tensor_without_a_slice_means_nothing_written(bad: tuple[str, Any]) -> None:
    model = CausalLMDouble(tied=False)
    before = snapshot(model)
    loader = FastLoader(lambda: model, parameter_views)
    assert not loader.load([*random_update(checkpoint_shapes(tied=False), seed=3), bad])
    after = snapshot(model)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_a_parameter_with_its_own_loader_gets_no_slice() -> None:
    """Gemma's norms add 1 in their weight loader: only the verified loaders' parameters are copied."""
    model = CausalLMDouble(tied=False)

    def _weight_loader(param: Any, loaded: Any) -> None:
        param.data.copy_(loaded + 1)

    model.model.norm.weight.weight_loader = _weight_loader
    plan = parameter_views(model)
    assert set(checkpoint_shapes(tied=False)) - set(plan.views) == {"model.norm.weight"}


def test_scalar_parameters_of_an_fp8_engine_do_not_break_the_plan() -> None:
    """An online-FP8 engine has 0-d parameters (the KV cache's ``k_scale``/``v_scale``, a fused
    layer's per-tensor scale): planning must not index their shape (on the H100 it raised
    IndexError and failed the update instead of falling back)."""
    model = CausalLMDouble(tied=False)
    attention = model.model.layers[0].self_attn
    attention.k_scale = torch.nn.Parameter(torch.tensor(1.0), requires_grad=False)
    attention.qkv_proj.input_scale = torch.nn.Parameter(torch.tensor(1.0), requires_grad=False)
    assert set(checkpoint_shapes(tied=False)) <= set(parameter_views(model).views)


def test_fused_sizes_other_than_the_parameter_rows_give_no_slices() -> None:
    model = CausalLMDouble(tied=False)
    model.model.layers[0].mlp.gate_up_proj.output_sizes = [INTER - 2, INTER]  # not what load_weights assumes
    missing = set(checkpoint_shapes(tied=False)) - set(parameter_views(model).views)
    assert missing == {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}


def test_a_tied_model_with_a_separate_head_parameter_loads_the_embedding_slowly() -> None:
    """Qwen2/3's load_weights also writes the embedding into a separate ``lm_head.weight``."""
    model = CausalLMDouble(tied=False)
    model.config.tie_word_embeddings = True
    plan = parameter_views(model)
    assert "model.embed_tokens.weight" not in plan.views and "lm_head.weight" in plan.skipped


def test_plan_is_cached_until_a_parameter_is_replaced() -> None:
    model = CausalLMDouble(tied=False)
    loader = FastLoader(lambda: model, parameter_views)
    first = loader.views()
    assert loader.views() is first and loader.plan_s == 0.0
    model.model.norm.weight.data = torch.zeros(HIDDEN)  # e.g. a memory release that moved it
    assert loader.load([("model.norm.weight", torch.full((HIDDEN,), 2.0))])
    assert loader.plan_s > 0 and torch.equal(model.model.norm.weight, torch.full((HIDDEN,), 2.0))


def named(cls: str) -> Any:
    """A model whose class is named ``cls`` (all the architecture check looks at), with modules."""
    return type(cls, (torch.nn.Module,), {})()


def _reason(model: Any = None, **over: Any) -> str | None:
    fields: dict[str, Any] = {"device_type": "cuda", "tp_size": 1, "pp_size": 1, "loader_v2": False} | over
    return ineligible_reason(named("Qwen2ForCausalLM") if model is None else model, **fields)


def _with_module(kind: str, method: str | None = None) -> Any:
    model = named("LlamaForCausalLM")
    module = type(kind, (torch.nn.Module,), {})()
    if method is not None:
        module.quant_method = type(method, (), {})()
    model.add_module("layer", module)
    return model


@pytest.mark.parametrize(
    ("over", "model", "words"),
    [
        ({"device_type": "cpu"}, None, "device cpu"),
        ({"tp_size": 2}, None, "parallelism"),
        ({"pp_size": 2}, None, "parallelism"),
        ({"loader_v2": True}, None, "WEIGHT_LOADER_V2"),
        ({}, named("GemmaForCausalLM"), "not verified"),
        ({}, _with_module("QKVParallelLinearWithLoRA"), "LoRA"),
        ({}, _with_module("QKVParallelLinear", "Fp8LinearMethod"), "quantized (Fp8LinearMethod)"),
    ],
    ids=["cpu", "tp", "pp", "loader-v2", "gemma", "lora", "online-fp8"],
)
def test_ineligible_engines(over: dict[str, Any], model: Any, words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fast_load.ENV, raising=False)
    reason = _reason(model, **over)
    assert reason is not None and words in reason


def test_eligible_engine_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fast_load.ENV, raising=False)
    assert _reason() is None
    assert _reason(_with_module("QKVParallelLinear", "UnquantizedLinearMethod")) is None
    monkeypatch.setenv(fast_load.ENV, "0")
    reason = _reason()
    assert reason is not None and fast_load.ENV in reason
