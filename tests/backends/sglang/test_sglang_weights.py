"""Weights on SGLang, per tiny architecture (llama; qwen2 with q/k/v biases and a tied output head;
qwen3 with q/k norms): every transport loads the second model, the engine then serves it bit for
bit (``verify_weights``, checksums computed in the scheduler) and generates what HF transformers
computes from it (the tied head too), and a deliberately wrong tensor is caught. On CPU the
scheduler keeps ``load_weights`` (no fast in-place load)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch

from rlinfer_core.engine import Engine
from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model
from rlinfer_core.types import GenerateRequest, SamplingParams
from rlinfer_core.weights import Buckets, CheckpointDir, NamedTensors, WeightSource

PROMPT = [1, 17, 42, 99, 7]
TOKENS = 10


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    arch = request.param
    root = tmp_path_factory.mktemp(f"weights-{arch}")
    spec = TinyModelSpec(architecture=arch)
    paths = [make_tiny_model(root / name, seed=seed, spec=spec) for name, seed in (("a", 0), ("b", 1))]
    engine = Engine.open("sglang", model=str(paths[0]), dtype="float32", seed=0, max_model_len=256)
    yield {"arch": arch, "paths": paths, "engine": engine, "root": root}
    engine.shutdown()


def _tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    from rlinfer_core.transfer.disk import read_tensors

    return list(read_tensors(str(path)))


def _source(kind: str, tensors: list[tuple[str, torch.Tensor]], root: Path) -> WeightSource:
    if kind == "tensors":
        return NamedTensors.of(tensors)
    if kind == "buckets":
        from rlinfer_core.transfer.buckets import pack

        return Buckets(pack(tensors, max_bucket_bytes=1 << 16))
    from rlinfer_core.transfer.disk import save_dir

    path = root / f"ckpt-{len(list(root.iterdir()))}"
    save_dir(tensors, path)
    return CheckpointDir(str(path))


def _update(engine: Engine, kind: str, tensors: list[tuple[str, torch.Tensor]], root: Path) -> int:
    if kind != "broadcast":
        return engine.update_weights(_source(kind, tensors, root))
    from rlinfer_core.transfer.broadcast import WeightBroadcaster, free_port
    from rlinfer_core.weights import BroadcastGroup

    group = BroadcastGroup("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.init_weight_broadcast, group)
        sender = WeightBroadcaster(group)
        try:
            joined.result(timeout=60)
            pending = pool.submit(engine.update_weights, sender.source(tensors))
            sender.send(tensors)
            return pending.result(timeout=60)
        finally:
            sender.close()


def _hf_parity(engine: Engine, path: Path) -> float:
    """Greedy tokens equal HF's argmax from ``path``; returns max |Δlogprob| against HF."""
    from transformers import AutoModelForCausalLM

    request = GenerateRequest(
        prompt_token_ids=PROMPT, sampling=SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    )
    (c,) = engine.generate(request)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + list(c.token_ids)])).logits[0, len(PROMPT) - 1 : -1]
    assert list(c.token_ids) == logits.argmax(-1).tolist(), "greedy tokens equal HF argmax"
    ref = torch.log_softmax(logits.double(), -1)[torch.arange(TOKENS), torch.tensor(c.token_ids)]
    return float((torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max())


def test_tied_head_is_reported(world: dict[str, Any]) -> None:
    tied = world["engine"].model_info.tied_weights
    expected = {"lm_head.weight": "model.embed_tokens.weight"} if world["arch"] == "qwen2" else {}
    assert dict(tied) == expected
    checksums = world["engine"].weights_checksum()  # the head is reported even when tied
    assert "lm_head.weight" in checksums


@pytest.mark.parametrize("kind", ["tensors", "buckets", "disk", "broadcast"])
def test_every_transport_serves_what_was_sent(world: dict[str, Any], kind: str) -> None:
    engine, (a, b), root = world["engine"], world["paths"], world["root"]
    first, second = _tensors(a), _tensors(b)
    assert engine.verify_weights(first).ok, "the start weights are served"
    for tensors, path in ((second, b), (first, a)):
        _update(engine, kind, tensors, root)
        result = engine.verify_weights(tensors)
        assert result.ok, (kind, result.mismatched, result.missing)
        assert len(result.checked) == len(tensors) + (1 if world["arch"] == "qwen2" else 0), "tied head checked"
        assert _hf_parity(engine, path) < 1e-5, f"{kind}: logprobs equal HF ({world['arch']})"


def test_cpu_engine_keeps_load_weights(world: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """On CPU the fast path (rlinfer_sglang.scheduler.fast_load) must not apply: SGLang's CPU
    kernels may repack weights. The scheduler's outcome says so, and the update is served."""
    engine, (a, b), root = world["engine"], world["paths"], world["root"]
    for path in (b, a):
        tensors = _tensors(path)
        with caplog.at_level(logging.DEBUG, logger="rlinfer_sglang.weights"):
            _update(engine, "tensors", tensors, root)
        rows = [r.args for r in caplog.records if "scheduler outcomes" in str(r.msg)]
        loads = [row[1] for row in rows if isinstance(row, tuple) and row[0] == "tensors"]
        assert loads, rows
        (outcome,) = loads[-1]  # one TP rank
        assert outcome["fast_load"] == 0.0 and outcome["ok"]
        assert engine.verify_weights(tensors).ok


def test_fast_load_plan_on_the_real_module_tree(world: dict[str, Any]) -> None:
    """The fast path's plan over SGLang's own layers (their ``output_sizes``, ``org_vocab_size``
    and weight loaders): every checkpoint tensor has a slice, a tied head is skipped, the padded
    vocabulary is zero-filled. On CPU the engine is not eligible all the same."""
    engine, (a, _) = world["engine"], world["paths"]
    backend = engine.async_engine._backend
    plan = engine._run(backend._weights.scheduler_op({"op": "fast_plan"}, flush=False))["fast_plan"]
    names = {name for name, _ in _tensors(a)}
    tied = world["arch"] == "qwen2"
    assert set(plan["mapped"]) == (names - {"lm_head.weight"} if tied else names)
    assert plan["skipped"] == (["lm_head.weight"] if tied else [])
    assert set(plan["zeroed"]) <= {"model.embed_tokens.weight", "lm_head.weight"}
    assert plan["reason"] is not None and plan["reason"].startswith("device cpu")
    assert plan["fp8_reason"] is not None and plan["fp8_reason"].startswith("device cpu")


def test_a_wrong_tensor_is_detected(world: dict[str, Any]) -> None:
    engine, (a, _) = world["engine"], world["paths"]
    tensors = dict(_tensors(a))
    for name in ("model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        wrong = dict(tensors)
        wrong[name] = wrong[name].clone()
        wrong[name].view(-1)[3] += 1e-3
        result = engine.verify_weights(wrong)
        assert not result.ok and result.mismatched == (name,)
    if world["arch"] == "qwen2":
        wrong = dict(tensors)
        wrong["model.embed_tokens.weight"] = wrong["model.embed_tokens.weight"] * 1.001
        result = engine.verify_weights(wrong)
        assert set(result.mismatched) == {"model.embed_tokens.weight", "lm_head.weight"}
