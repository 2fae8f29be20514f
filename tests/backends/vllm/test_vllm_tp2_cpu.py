"""vLLM at tensor_parallel_size=2 on CPU: a weight update reaches both TP ranks (issue 12).

vLLM binds one NUMA node per CPU rank and refuses more ranks than nodes; on this one-node host the
backend gives each rank its own cores (``VLLM_CPU_OMP_THREADS_BIND``, ``rlinfer_core.cpu_binding``),
and this test leaves that to the backend. With the two ranks each holding half of every attention
and MLP layer, greedy parity with HF transformers after an update holds only if both ranks loaded
their slice of it. ~1.5 min on 2 cores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from vllm_test_helpers import PROMPTS, hf_greedy, state_dict

from rlinfer_core.engine import Engine
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.transfer.buckets import pack
from rlinfer_core.types import GenerateRequest, SamplingParams
from rlinfer_core.weights import Buckets, NamedTensors

pytest.importorskip("vllm")
TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm-tp2")
    paths = {name: make_tiny_model(root / name, seed=seed) for name, seed in (("a", 0), ("b", 1))}
    greedy = {name: hf_greedy(path, state_dict(path), PROMPTS, TOKENS) for name, path in paths.items()}
    assert greedy["a"] != greedy["b"], "premise: the two models' greedy outputs differ"
    return {"paths": paths, "greedy": greedy}


@pytest.fixture(scope="module")
def engine(models: dict[str, Any]) -> Iterator[Engine]:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two TP ranks need two cores")
    eng = Engine.open(
        "vllm",
        model=str(models["paths"]["a"]),
        dtype="float32",
        seed=0,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=8,
        tensor_parallel_size=2,
        startup_timeout_s=600.0,
    )
    try:
        yield eng
    finally:
        eng.shutdown()


def _assert_serves(engine: Engine, models: dict[str, Any], name: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    out = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=params) for p in PROMPTS])
    assert [list(c.token_ids) for c in out] == models["greedy"][name], f"greedy tokens equal HF's for model {name}"


def test_updates_reach_both_tp_ranks(engine: Engine, models: dict[str, Any]) -> None:
    workers = {role for role in engine.engine_processes() if role.startswith("Worker-")}
    assert workers == {"Worker-0", "Worker-1"}, f"premise: two TP workers, found {workers}"
    _assert_serves(engine, models, "a")

    engine.update_weights(NamedTensors.of(state_dict(models["paths"]["b"])))
    _assert_serves(engine, models, "b")
    engine.update_weights(Buckets(pack(list(state_dict(models["paths"]["a"]).items()), max_bucket_bytes=1 << 16)))
    _assert_serves(engine, models, "a")
    assert {role for role in engine.engine_processes() if role.startswith("Worker-")} == workers
