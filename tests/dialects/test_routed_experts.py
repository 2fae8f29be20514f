"""Routing replay over ``rlinfer serve`` (docs/server.md): ``return_routed_experts`` on the OpenAI
surface (nested lists over prompt + completion), SGLang's ``/generate`` (``meta_info.routed_experts``,
base64 int32 rows ``[start, prompt + output - 1)``) and vLLM's ``/inference/v1/generate``
(``routed_experts``, base64 ``.npy``), all from one real SGLang CPU engine on a tiny Qwen3-MoE
model started with ``enable_routed_experts``; and the refusal on an engine without the capability.

Run from ``.venvs/sglang`` (``make test-server-sglang``): three servers, one at a time (~20 s each).
"""

from __future__ import annotations

import base64
import importlib.util
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from dialect_servers import DialectServer, rlinfer_serve_command, started

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="needs the SGLang backend (.venvs/sglang)"
)

PROMPT = [1, 5, 6, 7, 9, 11]
MAX_TOKENS = 6
#: the tiny Qwen3-MoE model's experts and top_k (rlinfer_core.tiny_model.TinyModelSpec)
NUM_EXPERTS, TOP_K, LAYERS = 8, 2, 2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", 0, TinyModelSpec(architecture="qwen3_moe"))


def _serve(model: Path, dialect: str, tmp: Path, routes: bool) -> Iterator[DialectServer]:
    ready = tmp / "ready.json"
    command = [*rlinfer_serve_command("rlinfer-sglang", model, dialect, ready), "--served-model-name", "m"]
    if routes:
        command += ["--set", "enable_routed_experts=true"]
    with started(f"rlinfer-sglang-{dialect}", command, os.environ.copy(), tmp, ready, None) as served:
        yield served


@pytest.fixture(scope="module")
def sglang_server(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DialectServer]:
    """``--dialect sglang`` with capture on: serves both ``/generate`` and the OpenAI surface."""
    yield from _serve(moe_model, "sglang", tmp_path_factory.mktemp("sgl"), routes=True)


@pytest.fixture(scope="module")
def vllm_server(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DialectServer]:
    """``--dialect vllm`` with capture on."""
    yield from _serve(moe_model, "vllm", tmp_path_factory.mktemp("vllm"), routes=True)


@pytest.fixture(scope="module")
def plain_server(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DialectServer]:
    """``--dialect sglang`` without capture: the engine does not claim generate.routed_experts."""
    yield from _serve(moe_model, "sglang", tmp_path_factory.mktemp("plain"), routes=False)


def _openai_routes(client: httpx.Client, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json={**body, "return_routed_experts": True, **extra})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return dict(choice)


def _sglang_generate(client: httpx.Client, **extra: Any) -> httpx.Response:
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return client.post("/generate", json={"input_ids": PROMPT, "sampling_params": params, **extra})


def _check_rows(routes: np.ndarray, rows: int) -> None:
    """Shape, and every row a route: ``top_k`` distinct expert ids in ``[0, NUM_EXPERTS)``."""
    assert routes.shape == (rows, LAYERS, TOP_K)
    assert ((routes >= 0) & (routes < NUM_EXPERTS)).all()
    for row in routes.reshape(-1, TOP_K):
        assert len(set(row.tolist())) == TOP_K


def test_openai_choice_carries_routes_of_prompt_and_completion(sglang_server: DialectServer) -> None:
    with sglang_server.client() as client:
        choice = _openai_routes(client)
    routes = np.asarray(choice["routed_experts"])
    tokens = len(choice["prompt_token_ids"]) + len(choice["token_ids"])
    assert routes.shape == (tokens, LAYERS, TOP_K)
    _check_rows(routes[:-1], tokens - 1)
    assert (routes[-1] == -1).all()  # the last token is never fed through the model


def test_openai_chat_carries_routes(sglang_server: DialectServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    with sglang_server.client() as client:
        r = client.post("/v1/chat/completions", json={**body, "return_routed_experts": True, "ignore_eos": True})
        plain = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    tokens = len(choice["prompt_token_ids"]) + len(choice["token_ids"])
    _check_rows(np.asarray(choice["routed_experts"])[:-1], tokens - 1)
    assert "routed_experts" not in plain.json()["choices"][0]  # only when asked


def test_openai_stream_with_routes_is_refused(sglang_server: DialectServer) -> None:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "stream": True, "return_routed_experts": True}
    with sglang_server.client() as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "return_routed_experts"


def test_sglang_generate_routes_are_sglang_format_and_match_openai(sglang_server: DialectServer) -> None:
    with sglang_server.client() as client:
        choice = _openai_routes(client)
        r = _sglang_generate(client, return_routed_experts=True)
        start = _sglang_generate(client, return_routed_experts=True, routed_experts_start_len=len(PROMPT))
        without = _sglang_generate(client)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == choice["token_ids"]
    # SGLang's encoding: base64 of int32, rows for positions [0, prompt + output - 1)
    flat = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    rows = len(PROMPT) + len(out["output_ids"]) - 1
    routes = flat.reshape(rows, LAYERS, TOP_K)
    _check_rows(routes, rows)
    assert routes.tolist() == choice["routed_experts"][:-1]
    tail = np.frombuffer(base64.b64decode(start.json()["meta_info"]["routed_experts"]), dtype=np.int32)
    assert tail.reshape(-1, LAYERS, TOP_K).tolist() == routes[len(PROMPT) :].tolist()
    assert "routed_experts" not in without.json()["meta_info"]


def test_sglang_generate_start_past_prompt_is_refused(sglang_server: DialectServer) -> None:
    with sglang_server.client() as client:
        r = _sglang_generate(client, return_routed_experts=True, routed_experts_start_len=len(PROMPT) + 1)
    assert r.status_code == 400
    assert "routed_experts_start_len" in r.text


def test_vllm_generate_routes_are_npy_and_match_openai(vllm_server: DialectServer) -> None:
    params = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with vllm_server.client() as client:
        choice = _openai_routes(client)
        r = client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": params})
        start = {**params, "routed_experts_prompt_start": 2}
        r2 = client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": start})
    assert r.status_code == 200, r.text
    (out,) = r.json()["choices"]
    assert out["token_ids"] == choice["token_ids"]
    routes = np.load(io.BytesIO(base64.b64decode(out["routed_experts"])))
    _check_rows(routes, len(PROMPT) + len(out["token_ids"]) - 1)
    assert routes.tolist() == choice["routed_experts"][:-1]
    tail = np.load(io.BytesIO(base64.b64decode(r2.json()["choices"][0]["routed_experts"])))
    assert tail.tolist() == routes[2:].tolist()


def test_engine_without_capture_refuses_routes(plain_server: DialectServer) -> None:
    with plain_server.client() as client:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "return_routed_experts": True}
        openai = client.post("/v1/completions", json=body)
        sglang = _sglang_generate(client, return_routed_experts=True)
        plain = _sglang_generate(client)
    assert openai.status_code == 400
    assert openai.json()["error"]["type"] == "unsupported_capability"
    assert openai.json()["error"]["param"] == "generate.routed_experts"
    assert sglang.status_code == 400, sglang.text  # a refused request, as SGLang answers it
    assert sglang.json()["error"]["type"] == "unsupported_capability"
    assert "generate.routed_experts" in sglang.text
    assert plain.status_code == 200 and "routed_experts" not in plain.json()["meta_info"]
