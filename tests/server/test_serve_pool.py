"""``rlinfer serve`` over an rlinfer-ray pool: two real vLLM CPU replicas on a local Ray cluster,
started as a subprocess from a config file with a ``pool:`` section (``--routing`` from the flag).

Generation through the ``openai`` client, then a weight update over the control endpoint that must
reach every replica: the pool's checksum endpoint only answers when every serving replica reports
the same checksums, and round-robin routing sends the parity prompts to both replicas.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, BACKEND, MODEL_NAME, Served, completion_of, run_serve, write_config

pytest.importorskip("ray")
pytest.importorskip("rlinfer_ray.config_file")

TIMEOUT = 180.0
REPLICAS = 2


@pytest.fixture(scope="module")
def pool_server(tiny_models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    import yaml

    tmp = tmp_path_factory.mktemp("serve-pool")
    config = write_config(tmp / "rollout.yaml", tiny_models[0])
    data = yaml.safe_load(config.read_text())
    data["pool"] = {"replicas": REPLICAS, "policy": "session", "cpus_per_replica": 1}
    config.write_text(yaml.safe_dump(data))
    env = dict(os.environ, RLINFER_API_KEY=API_KEY)
    env.pop("RAY_ADDRESS", None)  # a local Ray instance of the server's own
    with run_serve(config, tmp, tiny_models, "--routing", "round_robin", env=env) as served:
        yield served


def test_pool_serves_completions_and_weight_updates_reach_every_replica(pool_server: Served) -> None:
    import openai

    from rlinfer_conformance.oracle import Oracle
    from rlinfer_conformance.world import LOGPROB_TOLERANCE

    url, h = pool_server.url, pool_server.control_headers
    assert f"a pool of {REPLICAS} {BACKEND} replicas (round_robin)" in pool_server.log.read_text()
    info = httpx.get(f"{url}/control/info", headers=h, timeout=TIMEOUT).json()
    assert info["broadcast_ranks"] == REPLICAS  # one rank per live replica at tensor_parallel_size 1
    assert "weights.delta" not in info["capabilities"]["supported"]  # the pool's honest capabilities

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    prompts = [[5, 17, 42, 99, 7, 12], [3, 3, 8, 200, 31], [11, 2, 64, 9], [70, 71, 72, 73, 74]]
    kwargs = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "logprobs": 0, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(prompt=prompts, **kwargs)
    assert len(out.choices) == len(prompts)
    for choice, prompt in zip(sorted(out.choices, key=lambda c: c.index), prompts, strict=True):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt
        assert len(extra["token_ids"]) == len(extra["token_logprobs"]) == 8
        assert all(lp <= 0.0 for lp in extra["token_logprobs"])
        assert extra["token_versions"] == [0] * 8

    before = httpx.get(f"{url}/control/weights_checksum", headers=h, timeout=TIMEOUT)
    assert before.status_code == 200, before.text  # every replica reports the same weights
    body = {"source": "disk", "path": str(pool_server.other_model)}
    r = httpx.post(f"{url}/control/update_weights", headers=h, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == 1
    assert httpx.get(f"{url}/control/weight_version", headers=h, timeout=TIMEOUT).json()["weight_version"] == 1
    after = httpx.get(f"{url}/control/weights_checksum", headers=h, timeout=TIMEOUT)
    assert after.status_code == 200, after.text  # still one set of weights across the replicas...
    assert after.json()["checksums"] != before.json()["checksums"]  # ...and it is the new one

    oracle = Oracle()
    oracle.add("other", pool_server.other_model)
    out = client.completions.create(prompt=prompts, **kwargs)  # round robin: both replicas answer
    for choice in out.choices:
        extra = choice.model_extra
        assert extra["token_versions"] == [1] * 8
        parity = oracle.check("other", *completion_of(extra, choice.finish_reason))
        assert parity.tokens_checked == 8
        assert not parity.argmax_mismatches, parity.argmax_mismatches
        assert parity.max_abs_logprob_delta <= LOGPROB_TOLERANCE
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
