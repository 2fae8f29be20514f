"""Fast in-place weight loading on vLLM (rlinfer_vllm.worker.fast_load over the core's FastLoader):
slice selection, the batched copy, the fallback decision (the engine-agnostic parts:
tests/core/test_fast_load.py).

The unit tests run on CPU over ``CausalLMDouble``, a small torch module built here that has the
layout vLLM's CUDA layers give Qwen2/Llama (fused ``qkv_proj``/``gate_up_proj`` with
``output_sizes``, a vocabulary padded past the checkpoint's, a tied head that is the embedding's
module, a rotary buffer; its layers and layout from ``causal_lm_layout``). Its oracle,
``causal_lm_layout.reference_load``, writes each checkpoint tensor the way
vLLM's weight loaders do, from offsets spelled out by hand (not via served.py).

The last test runs the real vLLM engine on CPU, where the fast path must not apply (the kernels
repack their weights): the worker says why, an update reports ``fast_load`` 0, and parity holds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

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
    Q,
    assert_same_params,
    assert_unchanged,
    checkpoint_shapes,
    random_update,
    reference_load,
    snapshot,
)

from rlinfer_vllm.worker import fast_load  # noqa: E402
from rlinfer_vllm.worker.fast_load import fast_loader, ineligible_reason, parameter_views  # noqa: E402

PADDED = 16  # the vocabulary rows of the engine's embedding (VOCAB in the checkpoint)


class CausalLMDouble(torch.nn.Module):
    """Two layers; ``tied``: ``lm_head`` is the embedding module (as Qwen2ForCausalLM does)."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = PlainDouble(PADDED, HIDDEN)
        self.model.layers = torch.nn.ModuleList(
            [LayerDouble(("inv_freq", torch.ones(HEAD // 2))), LayerDouble(("inv_freq", torch.ones(HEAD // 2)))]
        )
        self.model.norm = PlainDouble(HIDDEN)
        self.lm_head = self.model.embed_tokens if tied else PlainDouble(PADDED, HIDDEN)
        self.config = SimpleNamespace(tie_word_embeddings=tied)


def specs_of(shapes: dict[str, tuple[int, ...]], dtype: Any = None) -> dict[str, tuple[Any, tuple[int, ...]]]:
    return {name: (dtype or torch.float32, shape) for name, shape in shapes.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_every_checkpoint_tensor_has_a_parameter_slice(tied: bool) -> None:
    model = CausalLMDouble(tied)
    shapes = checkpoint_shapes(tied)
    views = parameter_views(model, specs_of(shapes), torch.float32)
    assert set(views) == set(shapes)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(v.untyped_storage().data_ptr() in storages for v in views.values())
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in views


@pytest.mark.parametrize("tied", [False, True])
def test_fast_load_matches_the_weight_loaders(tied: bool) -> None:
    fast_model, reference = CausalLMDouble(tied), CausalLMDouble(tied)
    shapes = checkpoint_shapes(tied)
    loader = fast_loader(lambda: fast_model, specs_of(shapes), torch.float32)
    for seed in (1, 2):
        update = random_update(shapes, seed)
        assert loader.load(update)
        for name, tensor in update:
            reference_load(reference, name, tensor)
        assert_same_params(fast_model, reference)
    assert torch.count_nonzero(fast_model.model.embed_tokens.weight[VOCAB:]) == 0  # padding kept zero
    assert fast_model.model.embed_tokens.weight[:VOCAB].abs().sum() > 0
    if tied:  # the head reads the embedding's tensor: the update reached it
        assert torch.equal(fast_model.lm_head.weight[:VOCAB], update[0][1])


def test_partial_update_of_one_fused_part_writes_only_its_rows() -> None:
    model = CausalLMDouble(tied=False)
    shapes = checkpoint_shapes(tied=False)
    loader = fast_loader(lambda: model, specs_of(shapes), torch.float32)
    before = snapshot(model)
    k = torch.full((KV, HIDDEN), 3.0)
    assert loader.load([("model.layers.1.self_attn.k_proj.weight", k)])
    after = snapshot(model)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {"model.layers.1.self_attn.qkv_proj.weight"}
    qkv = after["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[Q : Q + KV], k) and torch.count_nonzero(qkv[:Q]) == 0
    assert torch.count_nonzero(qkv[Q + KV :]) == 0


@pytest.mark.parametrize("tie", ["module", "tensor"])
def test_tied_checkpoint_listing_the_head_skips_it(tie: str) -> None:
    """A tied model whose checkpoint also lists lm_head.weight: load_weights skips it (its
    skip_prefixes), and so does the fast path, tied by module (Qwen2) or by tensor (Llama)."""
    model = CausalLMDouble(tied=True)
    if tie == "tensor":
        model.lm_head = PlainDouble(PADDED, HIDDEN)
        model.lm_head.weight = model.model.embed_tokens.weight
    shapes = checkpoint_shapes(tied=True) | {"lm_head.weight": (VOCAB, HIDDEN)}
    loader = fast_loader(lambda: model, specs_of(shapes), torch.float32)
    assert set(shapes) - set(loader.views()) == {"lm_head.weight"}
    head, embed = torch.full((VOCAB, HIDDEN), 5.0), torch.full((VOCAB, HIDDEN), 7.0)
    assert loader.load([("lm_head.weight", head), ("model.embed_tokens.weight", embed)])
    assert torch.equal(model.lm_head.weight[:VOCAB], embed)  # the head reads the embedding
    reference = CausalLMDouble(tied=True)
    reference_load(reference, "lm_head.weight", head)
    reference_load(reference, "model.embed_tokens.weight", embed)
    assert torch.equal(reference.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_names_sharing_bytes_fall_back() -> None:
    """A head tied by tensor that the config does not declare tied: load_weights would write
    both names into one tensor, in checkpoint order. Neither name gets a slice."""
    model = CausalLMDouble(tied=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    shapes = checkpoint_shapes(tied=False)
    loader = fast_loader(lambda: model, specs_of(shapes), torch.float32)
    assert set(shapes) - set(loader.views()) == {"lm_head.weight", "model.embed_tokens.weight"}
    before = snapshot(model)
    assert not loader.load([("model.norm.weight", torch.ones(HIDDEN)), ("lm_head.weight", torch.ones(VOCAB, HIDDEN))])
    assert_unchanged(model, before)
    assert loader.load([("model.norm.weight", torch.ones(HIDDEN))])


@pytest.mark.parametrize(
    "bad",
    [
        ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(HEAD // 2)),  # a buffer
        ("model.layers.9.mlp.up_proj.weight", torch.ones(INTER, HIDDEN)),  # no such module
        ("model.norm.weight", torch.ones(HIDDEN, dtype=torch.float64)),  # another dtype
        ("model.norm.weight", torch.ones(HIDDEN + 1)),  # another shape
    ],
    ids=["buffer", "unknown", "dtype", "shape"],
)
def test_one_tensor_without_a_slice_means_nothing_written(bad: tuple[str, Any]) -> None:
    model = CausalLMDouble(tied=False)
    shapes = checkpoint_shapes(tied=False) | {"model.layers.0.self_attn.rotary_emb.inv_freq": (HEAD // 2,)}
    loader = fast_loader(lambda: model, specs_of(shapes), torch.float32)
    update = [*random_update(checkpoint_shapes(tied=False), seed=3), bad]
    assert not loader.load(update)
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_served_dtype_other_than_the_checkpoint_falls_back() -> None:
    """dtype="auto" with a bf16 checkpoint on a float32 engine: load_weights casts, we do not."""
    model = CausalLMDouble(tied=False)
    shapes = checkpoint_shapes(tied=False)
    assert parameter_views(model, specs_of(shapes, torch.bfloat16), torch.float32) == {}


def test_a_copy_is_not_a_destination(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where served.py reads a weight back through a kernel (CPU), the result is a new tensor:
    writing it would change nothing the engine serves."""
    from rlinfer_vllm.worker import served

    real = served.served_tensors

    def with_copies(model: Any, names: Any, dtype: Any) -> dict[str, Any]:
        out = real(model, names, dtype)
        return {n: t.clone() if n.endswith("o_proj.weight") else t for n, t in out.items()}

    monkeypatch.setattr(served, "served_tensors", with_copies)
    model = CausalLMDouble(tied=False)
    shapes = checkpoint_shapes(tied=False)
    views = parameter_views(model, specs_of(shapes), torch.float32)
    assert set(shapes) - set(views) == {f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)}


def test_a_layout_the_plan_cannot_read_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinfer_vllm.worker import served

    def broken(model: Any, names: Any, dtype: Any) -> dict[str, Any]:
        raise RuntimeError("unexpected module layout")

    monkeypatch.setattr(served, "served_tensors", broken)
    model = CausalLMDouble(tied=False)
    loader = fast_loader(lambda: model, specs_of(checkpoint_shapes(tied=False)), torch.float32)
    assert not loader.load([("model.norm.weight", torch.ones(HIDDEN))])
    assert torch.count_nonzero(model.model.norm.weight) == 0


def test_views_are_cached_until_a_parameter_is_replaced() -> None:
    model = CausalLMDouble(tied=False)
    shapes = checkpoint_shapes(tied=False)
    loader = fast_loader(lambda: model, specs_of(shapes), torch.float32)
    first = loader.views()
    assert loader.plan_s > 0
    assert loader.views() is first and loader.plan_s == 0.0
    # a full reload may give a parameter new memory: the old views would write into nothing served
    model.model.norm.weight.data = torch.zeros(HIDDEN)
    assert loader.load([("model.norm.weight", torch.full((HIDDEN,), 2.0))])
    assert loader.plan_s > 0
    assert torch.equal(model.model.norm.weight, torch.full((HIDDEN,), 2.0))
    loader.invalidate()
    assert loader.views() is not first and loader.plan_s > 0


def _config(**over: Any) -> Any:
    fields = {
        "device": "cuda",
        "quantization": None,
        "tp": 1,
        "pp": 1,
        "lora": None,
    } | over
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=fields["device"]),
        model_config=SimpleNamespace(quantization=fields["quantization"]),
        parallel_config=SimpleNamespace(tensor_parallel_size=fields["tp"], pipeline_parallel_size=fields["pp"]),
        lora_config=fields["lora"],
    )


def qwen2_double() -> Any:
    """An object whose class is named as vLLM's Qwen2 model class (all the check looks at)."""
    return type("Qwen2ForCausalLM", (), {})()


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"device": "cpu"}, "device cpu"),
        ({"quantization": "fp8"}, "quantized"),
        ({"tp": 2}, "parallelism"),
        ({"pp": 2}, "parallelism"),
        ({"lora": object()}, "LoRA"),
    ],
)
def test_ineligible_engines(over: dict[str, Any], words: str) -> None:
    reason = ineligible_reason(_config(**over), qwen2_double())
    assert reason is not None and words in reason


def test_eligible_engine_and_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fast_load.ENV, raising=False)
    assert ineligible_reason(_config(), qwen2_double()) is None
    reason = ineligible_reason(_config(), CausalLMDouble(tied=False))
    assert reason is not None and "not verified" in reason
    monkeypatch.setenv(fast_load.ENV, "0")
    reason = ineligible_reason(_config(), qwen2_double())
    assert reason is not None and fast_load.ENV in reason


# --- the real engine on CPU ---------------------------------------------------------------------


@pytest.fixture
def engine_and_models(qwen2_engine: Any, qwen2_models: tuple[Path, Path]) -> tuple[Any, Path, Path]:
    return qwen2_engine, *qwen2_models


def worker_timings(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """The worker's timings of the last update (the backend's debug line)."""
    rows = [r.args[1] for r in caplog.records if r.name == "rlinfer_vllm.backend" and "worker" in str(r.msg)]
    assert rows and isinstance(rows[-1], dict)
    return rows[-1]


def test_cpu_engine_falls_back_and_keeps_parity(
    engine_and_models: tuple[Any, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from vllm_test_helpers import PROMPTS, hf_greedy, state_dict

    from rlinfer_core.types import GenerateRequest, SamplingParams
    from rlinfer_core.weights import NamedTensors

    engine, base, other = engine_and_models
    backend = engine.async_engine._backend
    if backend.platform != "cpu":
        pytest.skip("the CPU fallback; test_cuda_engine_loads_fast covers CUDA")
    state = engine._run(backend.transport.rpc("rlinfer_fast_load_state"))
    assert not state["active"] and "reload mode" in state["reason"]
    # the selection itself on the real module tree: linear layers' weights are read back through
    # their repacked CPU kernels (copies, no slice to write); embeddings and norms are views
    mapped = set(state["mapped"])
    assert "model.embed_tokens.weight" in mapped and "model.norm.weight" in mapped
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight", "o_proj.weight")) for n in mapped)
    assert len(mapped) < state["total"]

    weights = state_dict(other)
    with caplog.at_level(logging.DEBUG, logger="rlinfer_vllm.backend"):
        engine.update_weights(NamedTensors.of(weights))
    timings = worker_timings(caplog)
    assert timings["fast_load"] == 0.0 and timings["load_s"] > 0
    assert engine.verify_weights(weights).ok
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=params) for p in PROMPTS])
    untied = weights | {"lm_head.weight": weights["model.embed_tokens.weight"]}  # HF's tie, spelled out
    assert [list(c.token_ids) for c in out] == hf_greedy(other, untied, PROMPTS, 6)
    engine.update_weights(NamedTensors.of(state_dict(base)))
    assert engine.verify_weights(state_dict(base)).ok


def test_cuda_engine_loads_fast(engine_and_models: tuple[Any, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    """On a GPU (vLLM CUDA build): CUDA tensors load by the batched copy, full or partial, and the
    served weights, the tied head included, are then bit-equal to them; host tensors take
    load_weights."""
    from vllm_test_helpers import PROMPTS, hf_greedy, state_dict

    from rlinfer_core.types import GenerateRequest, SamplingParams
    from rlinfer_core.weights import NamedTensors

    engine, base, other = engine_and_models
    backend = engine.async_engine._backend
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    if backend.platform != "cuda":
        pytest.skip("needs vLLM on CUDA")
    state = engine._run(backend.transport.rpc("rlinfer_fast_load_state"))
    if fast_load.ENV in str(state["reason"]):
        pytest.skip(f"{fast_load.ENV}=0")
    assert state["active"] and state["reason"] is None and len(state["mapped"]) == state["total"]
    weights = {n: t.to("cuda") for n, t in state_dict(other).items()}
    k_name = next(n for n in weights if n.endswith("k_proj.bias"))
    embed = "model.embed_tokens.weight"
    partial = {k_name: torch.randn_like(weights[k_name]), embed: torch.randn_like(weights[embed])}
    for update, served in ((weights, weights), (partial, weights | partial)):
        with caplog.at_level(logging.DEBUG, logger="rlinfer_vllm.backend"):
            engine.update_weights(NamedTensors.of(update))
        assert worker_timings(caplog)["fast_load"] == 1.0
        assert engine.verify_weights(served).ok
        # the tied head serves the new embedding (a tied checkpoint has no lm_head.weight to verify
        # by checksum): greedy tokens as HF computes them with that embedding as its head
        out = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=greedy) for p in PROMPTS])
        untied = {n: t.cpu() for n, t in served.items()} | {"lm_head.weight": served[embed].cpu()}
        assert [list(c.token_ids) for c in out] == hf_greedy(other, untied, PROMPTS, 6)
    host = state_dict(base)
    with caplog.at_level(logging.DEBUG, logger="rlinfer_vllm.backend"):
        engine.update_weights(NamedTensors.of(host))
    assert worker_timings(caplog)["fast_load"] == 0.0
    assert engine.verify_weights(host).ok
