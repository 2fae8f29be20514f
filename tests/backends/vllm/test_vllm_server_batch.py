"""Server mode's batch endpoint (``rlinfer_vllm.api_server.batch_route``) in a real ``vllm serve``.

One launched server (tiny model, CPU) per path of the endpoint: through vLLM's token-endpoint
handler (vLLM 0.32) and through the engine client (the path vLLM 0.26 takes, forced here with
``RLINFER_VLLM_BATCH_ENGINE=1``). A batch with one request the server refuses raises
InvalidRequest naming vLLM's reason and leaves the engine serving the oracle's tokens; the
endpoint's own answers to a malformed body and a wrong method are 4xx JSON errors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("vllm")

from vllm_test_helpers import ENGINE_FIELDS, PROMPTS, hf_greedy, state_dict

from rlinfer_core.engine import open_engine
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import GenerateRequest, SamplingParams

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm-batch") / "seed0", seed=0)


@pytest.fixture(scope="module", params=["token_handler", "engine_client"])
def engine(request: pytest.FixtureRequest, model: Path) -> Iterator[Any]:
    from rlinfer_vllm.api_server.engine_route import FORCE_ENV

    saved = os.environ.get(FORCE_ENV)
    os.environ[FORCE_ENV] = "1" if request.param == "engine_client" else "0"
    try:  # the server inherits the variable at launch
        engine = open_engine("vllm", model=str(model), mode="server", load_entry_point_plugins=False, **ENGINE_FIELDS)
    finally:
        if saved is None:
            os.environ.pop(FORCE_ENV, None)
        else:
            os.environ[FORCE_ENV] = saved
    try:
        yield engine
    finally:
        engine.shutdown()


def _launched_url(engine: Any) -> str:
    import psutil  # type: ignore[import-untyped,unused-ignore]

    pid = engine.engine_processes()["APIServer"]
    argv = psutil.Process(pid).cmdline()
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def test_refused_request_in_a_batch_raises_and_the_engine_keeps_serving(engine: Any, model: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [
        GenerateRequest(prompt_token_ids=PROMPTS[0], sampling=greedy),
        GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=2, n=64)),  # > max_num_seqs
        GenerateRequest(prompt_token_ids=PROMPTS[1], sampling=greedy),
    ]
    with pytest.raises(InvalidRequest) as refused:
        engine.generate(batch)
    assert "max_num_seqs" in str(refused.value)
    assert engine.in_flight == frozenset()
    out = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=greedy) for p in PROMPTS])
    assert [list(c.token_ids) for c in out] == hf_greedy(model, state_dict(model), PROMPTS, MAX_TOKENS)


def test_malformed_batch_bodies_are_4xx_json(engine: Any) -> None:
    import httpx

    from rlinfer_vllm.api_server.batch_route import PATH

    url = _launched_url(engine) + PATH
    bad = httpx.post(url, json={"requests": "not a list"}, timeout=30.0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "requests"
    assert httpx.get(url, timeout=30.0).status_code == 405
    lines = httpx.post(url, json={"requests": [{"token_ids": [1], "sampling_params": {"n": "x"}}]}, timeout=30.0)
    assert lines.status_code == 200
    (line,) = [x for x in lines.text.splitlines() if x]
    assert '"status": 400' in line and "sampling_params" in line


def test_the_server_reports_which_path_it_runs(engine: Any, request: pytest.FixtureRequest) -> None:
    import httpx

    from rlinfer_vllm.api_server.engine_route import FEATURES_PATH, VERSION_PATH

    features = httpx.get(_launched_url(engine) + FEATURES_PATH, timeout=30.0).json()
    via_engine = request.node.callspec.params["engine"] == "engine_client"
    assert features["batch_via_engine"] is via_engine
    assert features["token_version_spans"] is True and features["release_kv_cache_memory"] is True  # vLLM 0.32
    assert features["cache_salt"] is True
    version = httpx.post(_launched_url(engine) + VERSION_PATH, json={"new_version": "0"}, timeout=30.0)
    assert version.status_code == (200 if via_engine else 404)


def test_logprobs_and_versions_come_back_in_one_shape(engine: Any) -> None:
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=True)
    (done,) = engine.generate([GenerateRequest(prompt_token_ids=PROMPTS[0], sampling=sampling)])
    assert len(done.token_ids) == MAX_TOKENS and len(done.logprobs) == MAX_TOKENS
    assert done.top_logprobs is not None and all(len(top) == 2 for top in done.top_logprobs)
    # greedy: the sampled token is the most likely one, so it leads its position's top 2
    assert all(max(top, key=top.__getitem__) == t for top, t in zip(done.top_logprobs, done.token_ids, strict=True))
    assert all(
        abs(top[t] - lp) < 1e-5 for top, t, lp in zip(done.top_logprobs, done.token_ids, done.logprobs, strict=True)
    )
    assert done.prompt_logprobs is not None and done.prompt_logprobs[0] is None
    assert len(done.prompt_logprobs) == len(PROMPTS[0])
    assert done.token_versions == (0,) * MAX_TOKENS


def test_an_update_leaves_no_stale_prefix_on_either_path(engine: Any, model: Path, tmp_path: Path) -> None:
    """Requests carry their version's cache_salt on both paths (the engine client's passes it
    on), and the update resets nothing: a long prompt cached before it is answered by the new
    weights after it."""
    from rlinfer_core.weights import NamedTensors

    long_prompt = [1, *(3 + (7 * i) % 97 for i in range(299))]  # several KV blocks
    other = make_tiny_model(tmp_path / "seed1", seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def tokens() -> list[int]:
        (done,) = engine.generate([GenerateRequest(prompt_token_ids=long_prompt, sampling=greedy)])
        return list(done.token_ids)

    assert engine.async_engine._backend.transport.salted
    assert tokens() == hf_greedy(model, state_dict(model), [long_prompt], MAX_TOKENS)[0]  # now cached
    engine.update_weights(NamedTensors.of(state_dict(other)))
    try:
        assert tokens() == hf_greedy(other, state_dict(other), [long_prompt], MAX_TOKENS)[0]
    finally:
        engine.update_weights(NamedTensors.of(state_dict(model)))


def test_engine_client_answers_read_back_exactly() -> None:
    """The engine-client path's answer (vLLM's own output types in, 0.32's JSON shape out) reads
    back through the client's converter: ranked top logprobs, -inf prompt logprobs, stop reasons,
    per-token versions from the spans."""

    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from rlinfer_core.types import FinishReason
    from rlinfer_vllm import token_endpoint as convert
    from rlinfer_vllm.api_server import engine_route

    def lp(value: float, rank: int) -> Logprob:
        return Logprob(logprob=value, rank=rank)

    rows = [
        {7: lp(-0.1, 1), 9: lp(-2.0, 2), 3: lp(-3.0, 3)},  # sampled token ranked first
        {8: lp(-5.0, 4), 1: lp(-0.5, 1), 2: lp(-1.0, 2), 4: lp(-1.5, 3)},  # sampled outside the top 2
    ]
    out = CompletionOutput(
        index=0, text="", token_ids=[7, 8], cumulative_logprob=None, logprobs=rows, finish_reason="stop", stop_reason=8
    )
    final = RequestOutput(
        request_id="generate-tokens-r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=[None, {2: lp(-1.0, 5)}, {3: lp(float("-inf"), 9)}],
        outputs=[out],
        finished=True,
    )

    class Versions:  # the engine's counts: the last token after a switch to version 1
        def take(self, request_id: str, index: int, count: int) -> tuple[int, ...]:
            assert (request_id, index) == ("generate-tokens-r", 0)
            return (0,) * (count - 1) + (1,)

    request = GenerateRequest(
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=True, stop_token_ids=(8,)),
        request_id="r",
    )
    answer = json.loads(json.dumps(engine_route.answer("r", "generate-tokens-r", final, Versions(), with_top=True)))
    assert set(answer["choices"][0]) >= {"lp", "top"} and "logprobs" not in answer["choices"][0]
    (done,) = convert.completions(request, [1, 2, 3], answer, 0.1, live_version=1)
    assert done.token_ids == (7, 8) and done.logprobs == (-0.1, -5.0)
    assert done.top_logprobs == ({7: -0.1, 9: -2.0}, {1: -0.5, 2: -1.0})
    assert done.prompt_logprobs == (None, -1.0, float("-inf"))
    assert done.finish_reason is FinishReason.STOP and done.stop_reason == 8
    assert done.token_versions == (0, 1)
    assert engine_route.answer("r", "generate-tokens-r", None, Versions(), with_top=True) == {
        "request_id": "r",
        "choices": [],
    }
    sampled_only = json.loads(
        json.dumps(engine_route.answer("r", "generate-tokens-r", final, Versions(), with_top=False))
    )
    assert "top" not in sampled_only["choices"][0]
    (plain,) = convert.completions(
        attrs.evolve(request, sampling=attrs.evolve(request.sampling, logprobs=0)), [1, 2, 3], sampled_only, 0.1, 1
    )
    assert plain.logprobs == (-0.1, -5.0) and plain.top_logprobs is None


def test_compact_answers_read_back_as_the_token_endpoints_answers() -> None:
    """The batch route's compact logprobs (0.32 path: the token endpoint's answer, compacted) read
    back exactly as the token endpoint's own answer does: ranks cut at k, the sampled token's
    logprob also where it is outside the top k, -inf clamped both ways."""
    from rlinfer_vllm import token_endpoint as convert
    from rlinfer_vllm.api_server import engine_route

    def top(*entries: tuple[int, float, int]) -> list[dict[str, Any]]:
        return [{"token_id": t, "logprob": lp, "rank": r} for t, lp, r in entries]

    verbose = {
        "request_id": "r",
        "choices": [
            {
                "index": 0,
                "token_ids": [7, 8],
                "logprobs": {
                    "content": [
                        {"token_id": 7, "logprob": -0.1, "top_logprobs": top((9, -2.0, 2), (7, -0.1, 1), (3, -3.0, 3))},
                        {
                            "token_id": 8,
                            "logprob": convert.CLAMPED,
                            "top_logprobs": top((8, convert.CLAMPED, 4), (1, -0.5, 1), (2, -1.0, 2)),
                        },
                    ]
                },
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "prompt_logprobs": None,
    }
    for k in (0, 1, 2):
        request = GenerateRequest(
            prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2, logprobs=k), request_id="r"
        )
        compacted = json.loads(json.dumps(engine_route.compact(json.loads(json.dumps(verbose)), with_top=k > 0)))
        assert "logprobs" not in compacted["choices"][0]
        expected = convert.completions(request, [1, 2], verbose, 0.1, 0)
        assert convert.completions(request, [1, 2], compacted, 0.1, 0) == expected
        assert expected[0].logprobs == (-0.1, float("-inf"))
