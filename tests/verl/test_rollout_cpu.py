"""verl's own rollout classes over a real CPU engine (vLLM): the replica that verl's registry
returns for ``rollout.name: rlinfer`` starts its server actor on a local Ray cluster; the actor's
``generate`` answers verl's ``TokenOutput`` with oracle parity; the trainer's ``ServerAdapter``
updates the weights from a named-tensor generator, and the update lands (checksums verified).
verl's ``init_hybrid`` / ``init_colocated`` / ``init_standalone`` place replicas on GPUs, so the
test calls ``launch_servers`` (what each of them ends in) itself. ~1.5 min on 2 cores."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: the kit's engine settings (rlinfer_conformance.world.default_config) in verl's rollout section
ROLLOUT = {
    "_target_": "verl.workers.config.RolloutConfig",
    "name": "rlinfer",
    "tensor_model_parallel_size": 1,
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 16,
    "prompt_length": 32,
    "response_length": 12,
    "load_format": "auto",
    "enforce_eager": True,
    "free_cache_engine": False,
    "custom": {
        "rlinfer": {
            "backend": "vllm",
            "kv_cache_memory_bytes": 64 << 20,
            "seed": 0,
            "startup_timeout_s": 600.0,
            "http": {"port": 0, "served_model_name": "tiny"},  # rlinfer serve: verl's server_address
        }
    },
}
PROMPTS = ([5, 17, 42, 8, 99, 23], [11, 3, 64, 7])


def model_config(path: Path) -> Any:
    """verl's model section (``actor_rollout_ref.model``) for ``path``."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"_target_": "verl.workers.config.HFModelConfig", "path": str(path)})


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def oracle(model_dirs: dict[str, Path]) -> Any:
    from rlinfer_conformance.oracle import Oracle

    oracle = Oracle(weight_dtype="float32")
    for key, path in model_dirs.items():
        oracle.add(key, path)
    return oracle


@pytest.fixture(scope="module")
def replica(model_dirs: dict[str, Path], loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    import ray
    from omegaconf import OmegaConf
    from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class

    from rlinfer_conformance.world import BASE

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = OmegaConf.create(ROLLOUT)
        replica = get_rollout_replica_class("rlinfer")(
            replica_rank=0, config=config, model_config=model_config(model_dirs[BASE])
        )
        replica.rollout_mode = RolloutMode.STANDALONE
        loop.run_until_complete(replica.launch_servers())
        yield replica
        loop.run_until_complete(replica.server_handle.shutdown.remote())
    finally:
        ray.shutdown()


def generate(replica: Any, loop: asyncio.AbstractEventLoop, prompt: list[int], **params: Any) -> Any:
    from verl.workers.rollout.replica import TokenOutput

    sampling = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True, **params}
    out = loop.run_until_complete(
        replica.server_handle.generate.remote(prompt_ids=prompt, sampling_params=sampling, request_id="r")
    )
    assert isinstance(out, TokenOutput)
    return out


def check_parity(oracle: Any, key: str, prompt: list[int], out: Any) -> None:
    """Greedy tokens are the oracle's argmax (ties within the kit's band) and their logprobs match."""
    import torch

    from rlinfer_conformance.oracle import tie_band
    from rlinfer_conformance.world import LOGPROB_TOLERANCE

    tokens = out.token_ids
    assert tokens and out.log_probs is not None and len(out.log_probs) == len(tokens)
    logits = oracle.logits(key, prompt + tokens)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    logprobs = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(tokens):
        best = float(logits[i].max())
        assert float(logits[i, token]) >= best - tie_band(LOGPROB_TOLERANCE), f"token {i} is not the argmax"
        assert abs(out.log_probs[i] - float(logprobs[i, token])) < max(LOGPROB_TOLERANCE, 1e-4), (i, token)


def test_generate_returns_token_output_with_oracle_parity(replica: Any, oracle: Any, loop: Any) -> None:
    from rlinfer_conformance.world import BASE

    for prompt in PROMPTS:
        out = generate(replica, loop, list(prompt))
        # verl's length rule: response_length (12) is the default and the cap
        assert len(out.token_ids) <= 12 and out.stop_reason == "completed"
        assert out.extra_fields["global_steps"] is None and out.num_preempted is None
        check_parity(oracle, BASE, list(prompt), out)
    short = generate(replica, loop, list(PROMPTS[0]), max_tokens=3, logprobs=False, prompt_logprobs=0)
    assert len(short.token_ids) == 3 and short.log_probs is None
    assert len(short.extra_fields["prompt_ids"]) == len(PROMPTS[0])  # verl's rows: one per prompt token
    assert short.extra_fields["prompt_ids"][0] == [PROMPTS[0][1]]


def test_server_address_is_rlinfer_serve_over_the_same_engine(replica: Any, loop: Any) -> None:
    import httpx

    host, port = replica.server_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    prompt = list(PROMPTS[0])
    answer = httpx.post(
        f"http://{replica.server_address}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    over_http = answer.json()["choices"][0]["token_ids"]
    assert over_http == generate(replica, loop, prompt, max_tokens=4).token_ids


def test_bad_sampling_key_is_refused_and_the_engine_serves_on(replica: Any, oracle: Any, loop: Any) -> None:
    from rlinfer_conformance.world import BASE
    from rlinfer_core.errors import InvalidRequest, UnsupportedCapability

    # rlinfer's typed errors cross the actor call as themselves
    with pytest.raises(InvalidRequest, match="best_of") as info:
        generate(replica, loop, list(PROMPTS[0]), best_of=2)
    assert info.value.field == "best_of"
    with pytest.raises(UnsupportedCapability, match=r"generate\.multimodal"):
        loop.run_until_complete(
            replica.server_handle.generate.remote(
                prompt_ids=list(PROMPTS[0]), sampling_params={}, request_id="m", image_data=["x"]
            )
        )
    check_parity(oracle, BASE, list(PROMPTS[1]), generate(replica, loop, list(PROMPTS[1])))


def test_update_weights_from_named_tensor_generator_lands(
    replica: Any, oracle: Any, loop: Any, model_dirs: dict[str, Path]
) -> None:
    from omegaconf import OmegaConf
    from verl.workers.rollout.base import get_rollout_class

    from rlinfer_conformance.world import OTHER
    from rlinfer_core.checksum import verify
    from rlinfer_core.errors import UnsupportedCapability

    model = model_config(model_dirs[OTHER])
    adapter_cls = get_rollout_class("rlinfer", "async")
    adapter = adapter_cls(config=OmegaConf.create(ROLLOUT), model_config=model, device_mesh=None, replica_rank=0)
    sent = oracle.named_parameters(OTHER)

    def weights() -> Iterator[tuple[str, Any]]:
        yield from sent  # verl's checkpoint engine hands a generator of (name, tensor)

    loop.run_until_complete(adapter.update_weights(weights(), global_steps=7))
    server = replica.server_handle
    assert loop.run_until_complete(server.weight_version.remote()) == 1
    served = loop.run_until_complete(server.weights_checksum.remote())
    result = verify(served, sent, oracle.tied(OTHER))
    assert result.ok and not result.missing, (result.mismatched, result.missing)
    for prompt in PROMPTS:
        out = generate(replica, loop, list(prompt))
        assert out.extra_fields["global_steps"] == 7 and out.extra_fields["weight_version"] == 1
        check_parity(oracle, OTHER, list(prompt), out)
    # CPU engines cannot free memory: verl's release (free_cache_engine) says so instead of passing
    freeing = adapter_cls(
        config=OmegaConf.create({**ROLLOUT, "free_cache_engine": True}),
        model_config=model,
        device_mesh=None,
        replica_rank=0,
    )
    with pytest.raises(UnsupportedCapability, match=r"memory\.release"):
        loop.run_until_complete(freeing.release())
