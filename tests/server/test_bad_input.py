"""A hypothesis sweep of bad input over every endpoint: always a 4xx with a JSON error, never a
server death, and the engine keeps serving afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import MODEL_NAME, Served
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

ENDPOINTS = [
    ("POST", "/v1/completions", "generate"),
    ("POST", "/v1/chat/completions", "generate"),
    ("POST", "/v1/chat/completions/render", "generate"),
    ("POST", "/v1/completions/render", "generate"),
    ("POST", "/tokenize", "generate"),
    ("POST", "/detokenize", "generate"),
    ("GET", "/v1/models", "generate"),
    ("GET", "/metrics", "generate"),
    ("GET", "/health", "open"),
    ("POST", "/control/update_weights", "control"),
    ("POST", "/control/init_weight_broadcast", "control"),
    ("POST", "/control/pause", "control"),
    ("POST", "/control/resume", "control"),
    ("POST", "/control/abort", "control"),
    ("POST", "/control/release_memory", "control"),
    ("POST", "/control/resume_memory", "control"),
    ("POST", "/control/reset_prefix_cache", "control"),
    ("GET", "/control/weight_version", "control"),
    ("GET", "/control/weights_checksum", "control"),
    ("GET", "/control/info", "control"),
]
POST_PATHS = [p for m, p, _ in ENDPOINTS if m == "POST"]

scalars = st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
known = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "logprobs",
    "stop",
    "source",
    "path",
    "mode",
    "tags",
    "request_ids",
    "version",
    "master_port",
    "seed",
    "top_k",
    "logit_bias",
    "tools",
]

#: fields where some endpoint accepts a string (a text prompt, a stop string, the model's name...)
TAKES_STRING = {"model", "prompt", "stop", "source", "path", "mode"}


@st.composite
def bad_bodies(draw: st.DrawFn) -> bytes:
    """Bodies that are always wrong: garbage bytes, non-objects, or objects with a bad field."""
    kind = draw(st.sampled_from(["bytes", "nonobject", "unknown", "wrongtype"]))
    if kind == "bytes":
        return draw(st.binary(min_size=1, max_size=64).filter(lambda b: not b.strip().startswith(b"{")))
    if kind == "nonobject":
        return json.dumps(draw(st.lists(json_values, max_size=3) | scalars)).encode()
    body = {"model": MODEL_NAME, "prompt": [5, 6]}
    if kind == "unknown":  # "~" first: no endpoint has such a field (an optional OpenAI one would be valid)
        body["~" + draw(st.text(max_size=8))] = draw(json_values)
    elif draw(st.booleans()):  # a string where a string is never valid
        body[draw(st.sampled_from([k for k in known if k not in TAKES_STRING]))] = draw(st.text(max_size=5))
    else:  # an object where an object is never valid
        body[draw(st.sampled_from([k for k in known if k != "logit_bias"]))] = draw(
            st.dictionaries(st.text(max_size=3), scalars, max_size=2)
        )
    return json.dumps(body).encode()


def _check(r: httpx.Response, server: Served) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["message"] and "type" in error
    assert server.alive()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(POST_PATHS), body=bad_bodies(), token=st.sampled_from(["right", "none", "wrong"]))
@example(path="/control/resume", body=b"null", token="right")  # FastAPI reads JSON null as no body
@example(path="/control/reset_prefix_cache", body=b"null", token="right")
def test_bad_bodies_and_tokens(server: Served, path: str, body: bytes, token: str) -> None:
    headers = {"Content-Type": "application/json"}
    if token == "right":
        headers.update(server.control_headers)
    elif token == "wrong":
        headers["Authorization"] = "Bearer not-the-key-not-the-key"
    r = httpx.post(server.url + path, content=body, headers=headers, timeout=120.0)
    if path.startswith("/control/") and token != "right":
        assert r.status_code == 401
    _check(r, server)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    field=st.sampled_from(
        [
            "temperature",
            "top_p",
            "n",
            "max_tokens",
            "logprobs",
            "top_k",
            "min_p",
            "seed",
            "min_tokens",
            "presence_penalty",
            "repetition_penalty",
        ]
    ),
    value=st.integers(-(10**9), -3) | st.integers(10**10, 10**12) | st.floats(min_value=1e10, max_value=1e12),
)
def test_out_of_range_values_name_the_field(server: Served, field: str, value: float) -> None:
    body = {"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 2, field: value}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120.0)
    _check(r, server)
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("method,path,need", ENDPOINTS)
def test_oversize_and_unknown_paths(server: Served, method: str, path: str, need: str) -> None:
    headers = dict(server.control_headers)
    big = b"{" + b" " * (9 << 20) + b"}"
    r = httpx.request(method, server.url + path, content=big, headers=headers, timeout=120.0)
    if need == "open" or method == "GET":
        assert r.status_code in (200, 413, 501), r.text
    else:
        assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    r = httpx.get(server.url + path + "/nope", headers=headers, timeout=120.0)
    _check(r, server)


def test_engine_still_serves_after_the_sweep(server: Served, client) -> None:
    assert httpx.get(f"{server.url}/health", timeout=120.0).status_code == 200
    out = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert len(out.choices[0].model_extra["token_ids"]) >= 1
    assert server.alive()
