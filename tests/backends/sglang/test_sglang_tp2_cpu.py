"""SGLang at tensor_parallel_size=2 on CPU: a weight update reaches BOTH TP ranks (issue 12).

Each TP rank's scheduler deserializes its own entry of ``serialized_named_tensors``. In process, a
CPU tensor travels as a file descriptor that multiprocessing's resource sharer hands out once, so
one payload shared by both ranks kills rank 1's scheduler (``KeyError`` in the resource sharer;
found on 2xH200 with SGLang 0.5.16): the backend serializes once per rank. Server mode sends
file_system handles (shared-memory names), which any number of ranks can open.

SGLang runs two TP ranks on one NUMA node only with ``SGLANG_CPU_OMP_THREADS_BIND`` (one core
list per rank, ``|``-separated): without it ``numa_utils.init_threads_binding`` asserts
``world_size <= n_numa_node``. The backend sets it when the host has fewer NUMA nodes than ranks
(``rlinfer_sglang.engine_env``); this test leaves it to the backend. The ranks all-reduce over
gloo (the shared-memory all-reduce needs sgl-kernel's CPU ops, which the CPU env lacks). The tiny
model's logits then differ from HF's by float32 summation order only.

Runs with ``RLINFER_SGLANG_TP2_TESTS=1`` (``make test-sglang-tp2``, in ``make test``): in
process ~35 s, the server-mode case ~60 s on 2 cores. It fails unless each TP rank gets its own
payload (in process) and each rank's scheduler knows its TP rank (``scheduler.loader._tp_rank``,
whose outcome files are per rank).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch

from rlinfer_core.engine import Engine
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import GenerateRequest, SamplingParams
from rlinfer_core.weights import Buckets, NamedTensors

PROMPT = [1, 17, 42, 99, 7]
TOKENS = 10
pytestmark = pytest.mark.skipif(
    os.environ.get("RLINFER_SGLANG_TP2_TESTS") != "1",
    reason="SGLang TP=2 on CPU runs in `make test-sglang-tp2` (RLINFER_SGLANG_TP2_TESTS=1)",
)


def _tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    from rlinfer_core.transfer.disk import read_tensors

    return list(read_tensors(str(path)))


def _hf_greedy(path: Path) -> tuple[list[int], list[float]]:
    """HF transformers' greedy continuation of PROMPT and its logprobs (float64 log-softmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids, logprobs = list(PROMPT), []
    with torch.no_grad():
        for _ in range(TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(PROMPT) :], logprobs


def _scheduler_ranks() -> dict[int, int]:
    """TP rank -> pid of every SGLang scheduler below this process (titled ``sglang::scheduler_TPn``)."""
    import psutil

    ranks = {}
    for child in psutil.Process().children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if title.startswith("sglang::scheduler") and "_TP" in title:
            ranks[int(title.rsplit("_TP", 1)[1].split()[0].split("_")[0])] = child.pid
    return ranks


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sglang-tp2")
    paths = {name: make_tiny_model(root / name, seed=seed) for name, seed in (("a", 0), ("b", 1))}
    greedy = {name: _hf_greedy(path) for name, path in paths.items()}
    assert greedy["a"][0] != greedy["b"][0], "premise: the two models' greedy outputs differ"
    return {"paths": paths, "greedy": greedy}


@pytest.fixture(scope="module", params=["in-process", "server"])
def engine(request: pytest.FixtureRequest, models: dict[str, Any]) -> Iterator[Engine]:
    import torch.multiprocessing as tmp

    strategy = tmp.get_sharing_strategy()  # type: ignore[no-untyped-call]
    # the strategy a trainer process has unless something changed it (rlinfer_core.transfer.ipc
    # switches to file_system): file descriptors, the case where ranks cannot share a payload
    tmp.set_sharing_strategy("file_descriptor")  # type: ignore[no-untyped-call]
    extra: dict[str, Any] = {"mode": "server", "request_timeout_s": 120.0} if request.param == "server" else {}
    try:
        if len(os.sched_getaffinity(0)) < 2:
            pytest.skip("two TP ranks need two cores")
        engine = Engine.open(
            "sglang",
            model=str(models["paths"]["a"]),
            dtype="float32",
            seed=0,
            max_model_len=256,
            device="cpu",
            tensor_parallel_size=2,
            **extra,
        )
        try:
            yield engine
        finally:
            engine.shutdown()
    finally:
        tmp.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]


def _assert_serves(engine: Engine, models: dict[str, Any], name: str) -> None:
    request = GenerateRequest(
        prompt_token_ids=PROMPT, sampling=SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    )
    (completion,) = engine.generate(request)
    tokens, logprobs = models["greedy"][name]
    assert list(completion.token_ids) == tokens, f"greedy tokens equal HF's for model {name}"
    delta = max(abs(a - b) for a, b in zip(completion.logprobs, logprobs, strict=True))
    assert delta < 1e-4, f"logprobs equal HF's for model {name} (max delta {delta})"


def test_tensor_updates_reach_both_tp_ranks(engine: Engine, models: dict[str, Any]) -> None:
    from rlinfer_core.transfer.buckets import pack

    schedulers = _scheduler_ranks()
    assert sorted(schedulers) == [0, 1], f"premise: two TP scheduler processes, found {schedulers}"
    _assert_serves(engine, models, "a")

    engine.update_weights(NamedTensors.of(_tensors(models["paths"]["b"])))  # CPU tensors
    _assert_serves(engine, models, "b")
    engine.update_weights(Buckets(pack(_tensors(models["paths"]["a"]), max_bucket_bytes=1 << 16)))
    _assert_serves(engine, models, "a")

    assert _scheduler_ranks() == schedulers, "both TP schedulers survived the updates"
