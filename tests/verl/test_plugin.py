"""The plugin without an engine: discovery through `import verl`, the version check, verl's
rollout section as rlinfer's engine config, and verl's sampling dict as rlinfer's request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import Completion, FinishReason


def rollout_config(**fields: Any) -> Any:
    from verl.workers.config import RolloutConfig

    base: dict[str, Any] = {"name": "rlinfer", "tensor_model_parallel_size": 1}
    return RolloutConfig(**{**base, **fields})


def test_import_verl_discovers_the_plugin() -> None:
    import verl  # noqa: F401  (loads the verl.plugins entry points)
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from rlinfer_verl.adapter import ServerAdapter
    from rlinfer_verl.replica import RlinferReplica

    assert get_rollout_replica_class("rlinfer") is RlinferReplica
    assert get_rollout_class("rlinfer", "async") is ServerAdapter


def test_version_check_names_the_supported_range() -> None:
    from rlinfer_verl.compat import SUPPORTED_RANGE, UnsupportedVerlVersion, check_verl_version

    assert check_verl_version().startswith("0.9.")
    assert check_verl_version("0.9.4") == "0.9.4"
    for old_or_new in ("0.8.0", "0.10.0"):
        with pytest.raises(UnsupportedVerlVersion, match=r">=0\.9,<0\.10") as info:
            check_verl_version(old_or_new)
        assert old_or_new in str(info.value) and SUPPORTED_RANGE in str(info.value)


def test_rollout_section_maps_onto_engine_config(tmp_path: Path) -> None:
    from rlinfer_verl.config import rlinfer_rollout

    config = rollout_config(
        prompt_length=64,
        response_length=16,
        dtype="float32",
        max_num_seqs=8,
        load_format="auto",
        enforce_eager=True,
        free_cache_engine=False,
        temperature=0.7,
        engine_kwargs={"vllm": {"max_logprobs": 5}, "sglang": {"mem_fraction_static": 0.3}},
        custom={"rlinfer": {"backend": "sglang", "serving": "server", "kv_cache_memory_bytes": 1 << 26}},
    )
    rollout = rlinfer_rollout(config, str(tmp_path))
    engine = rollout.engine
    assert rollout.backend == "sglang" and rollout.pool is None
    assert engine.model == str(tmp_path) and engine.serving == "server"
    assert (engine.max_prompt_tokens, engine.max_response_tokens) == (64, 16)
    assert engine.default_sampling.max_tokens == 16 and engine.default_sampling.temperature == 0.7
    assert engine.engine_kwargs == {"mem_fraction_static": 0.3}  # the chosen backend's entry
    assert (engine.dtype, engine.max_num_seqs, engine.enforce_eager) == ("float32", 8, True)
    assert engine.kv_cache_memory_bytes == 1 << 26 and engine.enable_memory_release is False
    assert any("skip_tokenizer_init" in note for note in rollout.notes)


def test_rollout_section_pool_and_errors(tmp_path: Path) -> None:
    from rlinfer_verl.config import rlinfer_rollout

    pooled = rlinfer_rollout(rollout_config(custom={"rlinfer": {"pool": {"replicas": 2}}}), str(tmp_path))
    assert pooled.backend == "vllm" and pooled.pool == {"replicas": 2} and pooled.http is None
    served = rlinfer_rollout(rollout_config(custom={"rlinfer": {"http": True}}), str(tmp_path))
    assert served.http == {}
    with pytest.raises(InvalidRequest, match=r"custom\.rlinfer\.http"):
        rlinfer_rollout(rollout_config(custom={"rlinfer": {"http": "yes"}}), str(tmp_path))
    with pytest.raises(InvalidRequest, match=r"custom\.rlinfer\.kv_cache_size.*allowed keys"):
        rlinfer_rollout(rollout_config(custom={"rlinfer": {"kv_cache_size": 1}}), str(tmp_path))
    # verl refuses this for names other than vllm / sglang itself; a plain mapping reaches rlinfer
    with pytest.raises(InvalidRequest, match="disaggregation"):
        rlinfer_rollout({"name": "rlinfer", "disaggregation": {"enabled": True}}, str(tmp_path))
    with pytest.raises(InvalidRequest, match=r"serves rollout\.name 'rlinfer'"):
        rlinfer_rollout(rollout_config(name="vllm"), str(tmp_path))


def engine_config(**fields: Any) -> Any:
    from rlinfer_core.types import EngineConfig

    return EngineConfig(model="m", **fields)


def test_sampling_follows_verls_length_rule() -> None:
    from rlinfer_verl.sampling import verl_request

    config = engine_config(max_prompt_tokens=10, max_response_tokens=8, max_model_len=20)
    # no max_tokens: the room left by prompt_length + response_length, capped by response_length
    assert verl_request({}, 4, config).sampling.max_tokens == 8
    assert verl_request({}, 10, config).sampling.max_tokens == 8
    # asked for: capped by response_length and the context
    assert verl_request({"max_tokens": 3}, 4, config).sampling.max_tokens == 3
    assert verl_request({"max_new_tokens": 50}, 4, config).sampling.max_tokens == 8
    assert verl_request({"max_tokens": 50}, 15, config).sampling.max_tokens == 5
    with pytest.raises(InvalidRequest, match="no room"):
        verl_request({}, 20, config)


def test_sampling_keys_and_refusals() -> None:
    from rlinfer_verl.sampling import verl_request

    config = engine_config()
    request = verl_request(
        {"temperature": 0, "top_p": 1, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}, 3, config, seed=7
    )
    assert request.want_logprobs and request.sampling.temperature == 0.0 and request.sampling.seed == 7
    assert verl_request({"seed": 3}, 3, config, seed=7).sampling.seed == 3
    assert not verl_request({"logprobs": False}, 3, config).want_logprobs
    # verl repeats prompts rollout.n times itself: one sample per call whatever the section's n
    assert verl_request({}, 3, engine_config(default_sampling={"n": 4})).sampling.n == 1
    prompt = verl_request({"prompt_logprobs": 2}, 3, config)
    assert prompt.prompt_logprobs == 2 and prompt.sampling.prompt_logprobs and prompt.sampling.prompt_top_logprobs == 2
    with pytest.raises(InvalidRequest, match="best_of"):
        verl_request({"best_of": 2}, 3, config)
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        verl_request({"prompt_logprobs": -1}, 3, config)


def test_token_output_fields() -> None:
    from verl.workers.rollout.replica import TokenOutput

    from rlinfer_verl.sampling import token_output_fields, verl_request

    completion = Completion(
        request_id="r",
        index=0,
        prompt_token_ids=(5, 6, 7),
        token_ids=(8, 9),
        logprobs=(-0.5, -0.25),
        finish_reason=FinishReason.LENGTH,
        prompt_logprobs=(None, -1.0, -2.0),
        prompt_top_logprobs=(None, {6: -1.0, 1: -3.0}, {2: -0.5, 7: -2.0}),
        weight_version=3,
    )
    request = verl_request({"logprobs": True, "prompt_logprobs": 0}, 3, engine_config())
    out = TokenOutput(**token_output_fields(completion, request, global_steps=12))
    assert out.token_ids == [8, 9] and out.log_probs == [-0.5, -0.25] and out.stop_reason == "completed"
    assert out.extra_fields["global_steps"] == 12 and out.extra_fields["weight_version"] == 3
    assert out.extra_fields["prompt_ids"] == [[6], [7], [0]]
    assert out.extra_fields["prompt_logprobs"] == [[-1.0], [-2.0], [0.0]]
    top = verl_request({"prompt_logprobs": 2}, 3, engine_config())
    rows = token_output_fields(completion, top, None)["extra_fields"]
    assert rows["prompt_ids"] == [[6, 1], [2, 7], [0, 0]]
    # verl's routing replay: the completion's routes as an array [prompt + response tokens, layers, top_k]
    import attrs

    from rlinfer_core.routing import RoutedExperts

    routes = [[[1, 2], [3, 0]]] * 5
    routed = attrs.evolve(completion, routed_experts=RoutedExperts.from_array(routes))
    array = token_output_fields(routed, verl_request({}, 3, engine_config(), routed=True), None)["routed_experts"]
    assert array.shape == (5, 2, 2) and array.tolist() == routes
    assert verl_request({}, 3, engine_config(), routed=True).sampling.return_routed_experts
    aborted = Completion(
        request_id="r", index=0, prompt_token_ids=(5,), token_ids=(), logprobs=(), finish_reason=FinishReason.ABORT
    )
    fields = token_output_fields(aborted, verl_request({}, 1, engine_config()), None)
    assert fields["stop_reason"] == "aborted" and fields["log_probs"] is None
