"""The fast FP8 refit in SGLang's scheduler (rlinfer_sglang.scheduler.fp8_load): its plan over SGLang's
layout, the refusals, and the eligibility decision, on CPU.

SGLang's online FP8 does not run on CPU (``Fp8LinearMethod`` needs AMX there; capabilities.py), so
these tests use ``Fp8CausalLMDouble``, a small torch module built here with the layout SGLang's
``Fp8LinearMethod.process_weights_after_loading`` leaves on a CUDA layer with cutlass (E4M3 codes
stored as the transpose of a contiguous ``[out, in]``, a float32 scale ``[1, out]`` per output
channel, ``logical_widths`` in q/k/v and gate/up order; ``causal_lm_layout.Fp8LinearDouble``), a
quant-method double whose class has SGLang's name and module, and
``causal_lm_layout.fp8_quant_double`` for SGLang's ``per_token_group_quant_fp8``. The real op on
the real layers runs on the GPU (the last test: SGLang on CUDA only; and
``dev/gpu/run_suite.sh sglang fp8``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
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
    linear_shapes,
    param,
    reference_load,
    snapshot,
)

from rlinfer_core.transfer.fp8_fast_load import Fp8FastLoader  # noqa: E402
from rlinfer_sglang.scheduler import fast_load, fp8_load  # noqa: E402
from rlinfer_sglang.scheduler.fp8_load import build_plan, layer_problem  # noqa: E402

BF16 = torch.bfloat16
PADDED = 64
P = "model.layers.0"

#: a quant method whose class is SGLang's by name and module (all the plan's type check reads)
Fp8MethodDouble = type("Fp8LinearMethod", (), {"__module__": fp8_load.METHOD[0]})


def online_fp8(layer: Fp8LinearDouble) -> Fp8LinearDouble:
    """``layer`` with the method attributes SGLang 0.5.16 sets on Hopper for a BF16 checkpoint."""
    method = Fp8MethodDouble()
    method.is_checkpoint_fp8_serialized, method.block_quant, method.use_marlin = False, False, False
    method.use_mxfp8, method.cutlass_fp8_supported = False, True
    layer.quant_method = method
    return layer


def fp8_param(*shape: int) -> Any:
    """A contiguous E4M3 parameter of ``shape`` (codes stored untransposed)."""
    return torch.nn.Parameter(torch.zeros(shape, dtype=torch.float8_e4m3fn), requires_grad=False)


class VocabDouble(torch.nn.Module):
    """VocabParallelEmbedding: padded rows past ``org_vocab_size`` (non-zero, to see the zero-fill)."""

    def __init__(self) -> None:
        super().__init__()
        self.org_vocab_size = VOCAB
        self.weight = param(PADDED, HIDDEN, fill=0.5)


class Fp8CausalLMDouble(torch.nn.Module):
    """One Qwen2-shaped layer (q/k/v biases) with FP8 linears; float32 norms, embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = VocabDouble()
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = online_fp8(Fp8LinearDouble([Q, KV, KV], HIDDEN, (1, Q + 2 * KV)))
        layer.self_attn.qkv_proj.bias = param(Q + 2 * KV)
        layer.self_attn.o_proj = online_fp8(Fp8LinearDouble([HIDDEN], Q, (1, HIDDEN)))
        layer.mlp = torch.nn.Module()
        layer.mlp.gate_up_proj = online_fp8(Fp8LinearDouble([INTER, INTER], HIDDEN, (1, 2 * INTER)))
        layer.mlp.down_proj = online_fp8(Fp8LinearDouble([HIDDEN], INTER, (1, HIDDEN)))
        layer.input_layernorm = PlainDouble(HIDDEN)
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.norm = PlainDouble(HIDDEN)
        self.lm_head = VocabDouble()
        self.config = SimpleNamespace(tie_word_embeddings=False)


FP8_PARTS = {
    f"{P}.self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    f"{P}.self_attn.o_proj": ("o_proj",),
    f"{P}.mlp.gate_up_proj": ("gate_proj", "up_proj"),
    f"{P}.mlp.down_proj": ("down_proj",),
}
SHAPES = linear_shapes(P)
PLAIN = {
    "model.embed_tokens.weight": (VOCAB, HIDDEN),
    f"{P}.self_attn.q_proj.bias": (Q,),
    f"{P}.self_attn.k_proj.bias": (KV,),
    f"{P}.self_attn.v_proj.bias": (KV,),
    f"{P}.input_layernorm.weight": (HIDDEN,),
    "model.norm.weight": (HIDDEN,),
    "lm_head.weight": (VOCAB, HIDDEN),
}


def update(seed: int) -> list[tuple[str, Any]]:
    """BF16 weights for the FP8 layers, float32 for the rest (the double's plain dtype)."""
    gen = torch.Generator().manual_seed(seed)
    fp8 = [(n, torch.randn(s, generator=gen).to(BF16)) for n, s in SHAPES.items()]
    return [*fp8, *((n, torch.randn(s, generator=gen)) for n, s in PLAIN.items())]


def loader_for(model: Any) -> Fp8FastLoader:
    """The core's loader with SGLang's plan and the op's double."""
    return Fp8FastLoader(
        lambda: model, build_plan, fp8_quant_double, engine="SGLang", fallback="f", logger=fp8_load.log
    )


def test_plan_takes_sglangs_row_order_and_leaves_fp8_codes_out_of_the_slices() -> None:
    plan = build_plan(Fp8CausalLMDouble())
    parts = {layer.module: tuple(p.rsplit(".", 2)[1] for p in layer.parts) for layer in plan.layers}
    assert parts == FP8_PARTS
    assert {layer.module: layer.rows for layer in plan.layers}[f"{P}.self_attn.qkv_proj"] == (Q, KV, KV)
    assert set(PLAIN) <= set(plan.views) and not set(SHAPES) & set(plan.views)
    assert not [n for n, v in plan.views.items() if v.dtype == torch.float8_e4m3fn]
    assert set(plan.zeroed) == {"model.embed_tokens.weight", "lm_head.weight"}


def test_fast_fp8_load_matches_a_reload() -> None:
    """Codes and per-channel scales of each merged layer, in the live tensors; the rest as SGLang's
    weight loaders write it (causal_lm_layout.reference_load)."""
    model, reference = Fp8CausalLMDouble(), Fp8CausalLMDouble()
    loader = Fp8FastLoader(
        lambda: model, build_plan, fp8_quant_double, engine="SGLang", fallback="f", logger=fp8_load.log
    )
    live = {name: model.get_submodule(name).weight.data_ptr() for name in FP8_PARTS}
    sent = update(1)
    given = dict(sent)
    assert loader.load(sent)
    for name, leaves in FP8_PARTS.items():
        layer = model.get_submodule(name)
        merged = torch.cat([given[f"{name.rpartition('.')[0]}.{leaf}.weight"] for leaf in leaves])
        expected = SimpleNamespace(codes=torch.empty(merged.shape, dtype=torch.float8_e4m3fn))
        expected.scale = torch.empty(layer.weight_scale.shape)
        fp8_quant_double(expected, merged)
        assert layer.weight.data_ptr() == live[name], "written in place (captured CUDA graphs keep their addresses)"
        assert torch.equal(layer.weight.t().contiguous().view(torch.uint8), expected.codes.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, expected.scale), name
    for name in PLAIN:
        reference_load(reference, name, given[name])
    after, expected_plain = snapshot(model), snapshot(reference)
    plain_params = [n for n in after if not n.endswith(("proj.weight", "weight_scale"))]
    assert plain_params and all(torch.equal(after[n], expected_plain[n]) for n in plain_params)


def test_a_partial_fused_update_is_left_to_the_requantization() -> None:
    model = Fp8CausalLMDouble()
    loader = Fp8FastLoader(
        lambda: model, build_plan, fp8_quant_double, engine="SGLang", fallback="f", logger=fp8_load.log
    )
    before = snapshot(model)
    assert not loader.load([(n, t) for n, t in update(2) if "gate_proj" not in n])
    after = snapshot(model)
    assert all(torch.equal(after[n].view(torch.uint8), before[n].view(torch.uint8)) for n in before)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda layer: setattr(layer.quant_method, "use_marlin", True), "use_marlin': True"),
        (lambda layer: setattr(layer.quant_method, "block_quant", True), "block_quant': True"),
        (lambda layer: setattr(layer.quant_method, "cutlass_fp8_supported", False), "cutlass_fp8_supported': False"),
        (lambda layer: setattr(layer.quant_method, "is_checkpoint_fp8_serialized", True), "serialized': True"),
        (lambda layer: setattr(layer, "weight_scale", param(1)), "per output channel"),
        (lambda layer: setattr(layer, "input_scale", param(1)), "static input scale"),
        (lambda layer: setattr(layer, "weight", fp8_param(Q + 2 * KV, HIDDEN)), "transposed"),
    ],
    ids=["marlin", "block", "no-cutlass", "serialized", "per-tensor", "input-scale", "not-transposed"],
)
def test_layouts_it_does_not_know_are_refused(change: Any, words: str) -> None:
    model = Fp8CausalLMDouble()
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer_problem(layer) is None
    change(layer)
    assert words in str(layer_problem(layer))
    with pytest.raises(ValueError, match="qkv_proj"):
        build_plan(model)


def test_eligibility(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fast_load.ENV, raising=False)
    model = type("Qwen2ForCausalLM", (Fp8CausalLMDouble,), {})()
    fields: dict[str, Any] = {"device_type": "cuda", "tp_size": 1, "pp_size": 1, "loader_v2": False}
    assert fast_load.ineligible_reason(model, **fields, methods=fp8_load.METHODS) is None
    assert "quantized (Fp8LinearMethod)" in str(fast_load.ineligible_reason(model, **fields))  # not the BF16 path
    model.model.add_module("experts", torch.nn.Module())
    model.model.experts.quant_method = type("Fp8MoEMethod", (), {})()
    assert "Fp8MoEMethod" in str(fast_load.ineligible_reason(model, **fields, methods=fp8_load.METHODS))
    reason = fp8_load.engine_reason(Fp8CausalLMDouble())  # this scheduler's engine: on the CPU here
    assert reason is not None and reason.startswith("device cpu")
    assert fp8_load.loaded_fast_fp8(Fp8CausalLMDouble(), update(3)) == (False, 0.0)


# --- the real engine, SGLang on CUDA only ----------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Path]]:
    if not torch.cuda.is_available():
        pytest.skip("needs SGLang on CUDA (its online FP8 does not run on CPU)")
    from rlinfer_core.engine import open_engine
    from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("sglang-fp8-load")
    spec = TinyModelSpec(architecture="qwen2")  # q/k/v biases (plain copies)
    models = make_tiny_model(root / "seed0", seed=0, spec=spec), make_tiny_model(root / "seed1", seed=1, spec=spec)
    fields: dict[str, Any] = {
        "dtype": "bfloat16",  # SGLang's CUDA RMSNorm has no float32
        "device": "cuda",
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 << 20,
        "max_num_seqs": 16,
        "seed": 0,
        "startup_timeout_s": 600.0,
        "engine_kwargs": {"quantization": "fp8", "attention_backend": "triton"},  # as the GPU runs
    }
    eng = open_engine("sglang", model=str(models[0]), load_entry_point_plugins=False, **fields)
    try:
        yield eng, *models
    finally:
        eng.shutdown()


def test_cuda_fp8_engine_quantizes_updates_as_sglang_does(fp8_engine: tuple[Any, Path, Path]) -> None:
    """SGLang quantized the checkpoint at start; the same weights sent again through the fast path
    give bit-identical logprobs (same codes, same scales), another policy is served, and a partial
    fused update (the re-quantization path) is served too."""
    import logging

    from rlinfer_core.scoring import ScoreRequest
    from rlinfer_core.weights import NamedTensors

    engine, base, other = fp8_engine
    requests = [ScoreRequest([5, 6, 7, 10, 11], [12, 13, 14]), ScoreRequest([40, 41], [42, 43, 44, 45])]
    outcomes: list[dict[str, Any]] = []

    class Outcomes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            args = record.args if isinstance(record.args, tuple) else ()
            outcomes.extend(dict(a) for a in args if isinstance(a, dict) and "load_s" in a)

    handler, backend_log = Outcomes(logging.DEBUG), logging.getLogger("rlinfer_sglang")
    backend_log.addHandler(handler)
    backend_log.setLevel(logging.DEBUG)

    def scores() -> list[list[float]]:
        return [list(s.logprobs) for s in engine.score(requests)]

    def send(model: Path, keep: Any = None) -> dict[str, Any]:
        from rlinfer_core.transfer.disk import read_tensors

        wanted = [(n, t) for n, t in read_tensors(model) if n in engine.weight_specs and (keep is None or keep(n))]
        tensors = {n: t.to("cuda", BF16) for n, t in wanted}
        engine.update_weights(NamedTensors.of(tensors))
        return outcomes[-1]

    try:
        first = scores()
        assert send(base).get("fast_fp8") == 1.0, "the fast FP8 path did not run (its reason is logged at INFO)"
        assert scores() == first, "the fast path's FP8 weights differ from SGLang's own quantization"
        assert send(other).get("fast_fp8") == 1.0 and scores() != first
        assert send(base).get("fast_fp8") == 1.0 and scores() == first
        partial = send(other, keep=lambda n: "q_proj" in n)  # q without k/v: the re-quantization path
        assert partial.get("fast_fp8") == 0.0 and scores() != first
    finally:
        backend_log.removeHandler(handler)
