"""Control endpoints with httpx: the token guard, a weight update over HTTP with oracle parity,
and the rlinfer error -> HTTP status mapping."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import MODEL_NAME, Served, completion_of

CONTROL_GETS = ["/control/weight_version", "/control/info"]
CONTROL_POSTS = ["/control/resume", "/control/abort", "/control/pause", "/control/update_weights"]
TIMEOUT = 120.0


@pytest.mark.parametrize("path", CONTROL_GETS + CONTROL_POSTS)
def test_control_refuses_missing_and_wrong_tokens(server: Served, path: str) -> None:
    method = "GET" if path in CONTROL_GETS else "POST"
    for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key-wrong"}, {"Authorization": server.api_key}):
        r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=TIMEOUT)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["param"] == "authorization"


def test_control_accepts_the_token(server: Served) -> None:
    h = server.control_headers
    r = httpx.get(f"{server.url}/control/weight_version", headers=h, timeout=TIMEOUT)
    assert r.status_code == 200 and isinstance(r.json()["weight_version"], int)
    info = httpx.get(f"{server.url}/control/info", headers=h, timeout=TIMEOUT).json()
    assert info["weight_specs"] and info["capabilities"]["backend"]
    assert httpx.post(f"{server.url}/control/abort", headers=h, json={}, timeout=TIMEOUT).status_code == 200
    assert (
        httpx.post(f"{server.url}/control/pause", headers=h, json={"mode": "wait"}, timeout=TIMEOUT).status_code == 200
    )
    try:
        # paused: the engine reports it; health stays up
        assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    finally:
        assert httpx.post(f"{server.url}/control/resume", headers=h, timeout=TIMEOUT).status_code == 200


def test_unsupported_control_is_501_and_bad_versions_409(server: Served) -> None:
    h = server.control_headers
    info = httpx.get(f"{server.url}/control/info", headers=h, timeout=TIMEOUT).json()
    r = httpx.post(f"{server.url}/control/release_memory", headers=h, json={}, timeout=TIMEOUT)
    if "memory.release" in info["capabilities"]["supported"]:
        assert r.status_code == 200
        assert httpx.post(f"{server.url}/control/resume_memory", headers=h, json={}, timeout=TIMEOUT).status_code == 200
    else:
        assert r.status_code == 501 and r.json()["error"]["param"] == "memory.release"
    body = {"source": "disk", "path": str(server.other_model), "version": 0}
    r = httpx.post(f"{server.url}/control/update_weights", headers=h, json=body, timeout=TIMEOUT)
    assert r.status_code == 409 and r.json()["error"]["param"] == "version"
    r = httpx.post(
        f"{server.url}/control/update_weights",
        headers=h,
        json={"source": "disk", "path": "/nonexistent"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 422 and "/nonexistent" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def test_weight_update_over_http_then_oracle_parity(server: Served, client) -> None:
    from rlinfer_conformance.oracle import Oracle
    from rlinfer_conformance.world import LOGPROB_TOLERANCE

    h = server.control_headers
    before = httpx.get(f"{server.url}/control/weight_version", headers=h, timeout=TIMEOUT).json()["weight_version"]
    r = httpx.post(
        f"{server.url}/control/update_weights",
        headers=h,
        json={"source": "disk", "path": str(server.other_model)},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == before + 1
    oracle = Oracle()
    oracle.add("other", server.other_model)
    prompts = [[5, 17, 42, 99, 7, 12], [3, 3, 8, 200, 31]]
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    for choice in out.choices:
        extra = choice.model_extra
        assert extra["token_versions"] == [before + 1] * len(extra["token_ids"])
        parity = oracle.check("other", *completion_of(extra, choice.finish_reason))
        assert parity.tokens_checked == 12
        assert not parity.argmax_mismatches, parity.argmax_mismatches
        assert parity.max_abs_logprob_delta <= LOGPROB_TOLERANCE
    metrics = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    assert _metric(metrics, "rlinfer_weight_version") == before + 1
    assert _metric(metrics, "rlinfer_weight_update_seconds_count") >= 1
    assert _metric(metrics, "rlinfer_generated_tokens_total") >= 24
    assert 'rlinfer_http_requests_total{endpoint="/v1/completions",status="200"}' in metrics
