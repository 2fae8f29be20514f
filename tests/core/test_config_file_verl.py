"""verl's config files read as they are: layouts, every key group of verl's rollout section, and
the keys accepted without effect. No engine; the backends' mappings of the same files are checked
in tests/backends/*/test_*_config.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml

from rlinfer_core import verl_config
from rlinfer_core.config_file import allowed_keys, engine_config, read_config_file
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import EngineConfig, LogprobsMode

DATA = Path(__file__).parent / "data" / "verl"
VERL_FILES = sorted(DATA.glob("*.yaml"))

SEED = """\
model_path: /models/qwen
rollout:
  name: sglang
  mode: async
  skip_tokenizer_init: true
  prompt_length: 512
  response_length: 256
  tensor_model_parallel_size: 1
  gpu_memory_utilization: 0.5
  dtype: bfloat16
  enforce_eager: true
"""


def write(tmp_path: Path, body: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def rollout(tmp_path: Path, **keys: Any) -> EngineConfig:
    """EngineConfig from a file whose rollout section holds ``keys`` (model /m)."""
    return EngineConfig.from_file(str(write(tmp_path, yaml.safe_dump({"model_path": "/m", "rollout": keys}))))


def test_the_seed_config_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rlinfer_core.config_file"):
        settings = read_config_file(write(tmp_path, SEED))
    assert settings.backend == "sglang"
    config = engine_config(settings)
    assert config.model == "/models/qwen" and config.dtype == "bfloat16" and config.enforce_eager
    assert config.tensor_parallel_size == 1 and config.gpu_memory_utilization == 0.5
    assert (config.max_prompt_tokens, config.max_response_tokens) == (512, 256)
    assert config.default_sampling.max_tokens == 256
    assert config.serving == "inprocess", "verl's mode: async is not rlinfer's serving"
    noted = " ".join(settings.notes)
    assert "rollout.mode has no effect" in noted and "rollout.skip_tokenizer_init has no effect" in noted
    assert "rollout.mode has no effect" in caplog.text


@pytest.mark.parametrize("path", VERL_FILES, ids=lambda p: p.name)
def test_verls_own_configs_load(path: Path) -> None:
    settings = read_config_file(path)
    config = engine_config(settings, defaults={"model": "/m"})
    section = yaml.safe_load(path.read_text())
    verl_section = section.get("rollout") or section["actor_rollout_ref"]["rollout"]
    if verl_section.get("name") not in (None, "???"):
        assert settings.backend == verl_section["name"]
    tp = verl_section.get("tensor_model_parallel_size")
    assert config.tensor_parallel_size == (tp if tp is not None else 1)
    prompt = verl_section.get("prompt_length")
    if isinstance(prompt, int):
        assert config.max_prompt_tokens == prompt
    else:  # ${oc.select:data.max_prompt_length,512} or absent: verl's data.max_prompt_length
        assert config.max_prompt_tokens == section["data"]["max_prompt_length"]
    assert config.default_sampling.max_tokens == config.max_response_tokens


@pytest.mark.parametrize("name", ["ppo_trainer_excerpt.yaml", "ppo_megatron_trainer_excerpt.yaml"])
def test_every_rollout_key_of_verls_trainer_config_is_known(name: str) -> None:
    keys = set(yaml.safe_load((DATA / name).read_text())["actor_rollout_ref"]["rollout"]) - {"name"}
    assert keys <= verl_config.VERL_ROLLOUT_KEYS
    assert keys <= set(allowed_keys())


def test_the_trainer_layout_takes_model_and_rollout_from_actor_rollout_ref(tmp_path: Path) -> None:
    settings = read_config_file(DATA / "ppo_trainer_excerpt.yaml")
    config = engine_config(settings)
    assert config.model == str(Path("~/models/deepseek-llm-7b-chat").expanduser())
    assert settings.backend is None, "name: ??? (verl's MISSING) names no backend"
    assert any("actor_rollout_ref.rollout" in note for note in settings.notes)
    assert any("['data']" in note for note in settings.notes), "data is noted as ignored"
    assert config.load_format == "dummy", "verl's default: random weights until the trainer's first update"


def test_parallel_keys(tmp_path: Path) -> None:
    config = rollout(
        tmp_path,
        tensor_model_parallel_size=2,
        data_parallel_size=2,
        expert_parallel_size=4,
        pipeline_model_parallel_size=1,
    )
    assert (config.tensor_parallel_size, config.data_parallel_size, config.expert_parallel_size) == (2, 2, 4)
    assert config.world_size == 4
    with pytest.raises(InvalidRequest) as info:
        rollout(tmp_path, tensor_model_parallel_size=2, expert_parallel_size=3)
    assert info.value.field == "expert_parallel_size" and "must be 1 or" in str(info.value)


def test_engine_keys(tmp_path: Path) -> None:
    config = rollout(
        tmp_path,
        name="vllm",
        dtype="float16",
        enforce_eager=True,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        max_model_len=2048,
        engine_kwargs={"vllm": {"swap_space": 4}, "sglang": {"attention_backend": "triton"}},
    )
    assert (config.dtype, config.enforce_eager, config.enable_chunked_prefill) == ("float16", True, False)
    assert (config.enable_prefix_caching, config.max_num_seqs, config.max_num_batched_tokens) == (False, 8, 4096)
    assert config.max_model_len == 2048 and dict(config.engine_kwargs) == {"swap_space": 4}
    empty = rollout(tmp_path, name="sglang", engine_kwargs={"vllm": {}, "sglang": {}, "trtllm": {}})
    assert dict(empty.engine_kwargs) == {}, "verl's per-engine form with empty entries is no engine argument"


@pytest.mark.parametrize(
    "verl,ours",
    [("auto", "auto"), ("dummy", "dummy"), ("dummy_dtensor", "dummy"), ("hf", "auto"), ("safetensors", "safetensors")],
)
def test_load_format(tmp_path: Path, verl: str, ours: str) -> None:
    assert rollout(tmp_path, load_format=verl).load_format == ours


def test_load_format_names_the_allowed_values(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as info:
        rollout(tmp_path, load_format="megatron")
    assert info.value.field == "load_format" and "dummy_dtensor" in str(info.value)


def test_memory_keys(tmp_path: Path) -> None:
    assert rollout(tmp_path, free_cache_engine=True, gpu_memory_utilization=0.3).enable_memory_release
    assert not rollout(tmp_path, free_cache_engine=True, enable_sleep_mode=False).enable_memory_release
    assert not rollout(tmp_path, free_cache_engine=False, enable_sleep_mode=True).enable_memory_release


def test_lengths_are_limits_and_the_default_length(tmp_path: Path) -> None:
    config = rollout(tmp_path, prompt_length=100, response_length=50)
    assert (config.max_prompt_tokens, config.max_response_tokens, config.sampling().max_tokens) == (100, 50, 50)
    assert config.sampling(max_tokens=20).max_tokens == 20
    with pytest.raises(InvalidRequest) as info:
        EngineConfig(model="m", max_response_tokens=50, default_sampling={"max_tokens": 64})
    assert info.value.field == "default_sampling"


def test_lengths_come_from_verls_data_section_and_interpolations(tmp_path: Path) -> None:
    body = {
        "model_path": "/m",
        "data": {"max_prompt_length": 300, "max_response_length": 40},
        "rollout": {"prompt_length": "${oc.select:data.max_prompt_length,512}"},
    }
    config = EngineConfig.from_file(str(write(tmp_path, yaml.safe_dump(body))))
    assert (config.max_prompt_tokens, config.max_response_tokens) == (300, 40)
    body["rollout"] = {
        "prompt_length": "${oc.select:data.nothing_here,77}",
        "response_length": "${data.max_prompt_length}",
    }
    config = EngineConfig.from_file(str(write(tmp_path, yaml.safe_dump(body))))
    assert (config.max_prompt_tokens, config.max_response_tokens) == (77, 300)
    body["rollout"] = {"response_length": "${data.nothing_here}"}
    with pytest.raises(InvalidRequest) as info:
        EngineConfig.from_file(str(write(tmp_path, yaml.safe_dump(body))))
    assert info.value.field == "response_length" and "names nothing" in str(info.value)


def test_sampling_keys(tmp_path: Path) -> None:
    config = rollout(tmp_path, temperature=0.7, top_k=0, top_p=1, n=4, repetition_penalty=1.1, ignore_eos=True)
    s = config.default_sampling
    assert (s.temperature, s.top_k, s.top_p, s.n, s.repetition_penalty, s.ignore_eos) == (0.7, -1, 1.0, 4, 1.1, True)
    assert isinstance(s.top_p, float), "verl's top_p: 1 is a float here"
    assert rollout(tmp_path, temperature=0.7, do_sample=False).default_sampling.temperature == 0.0
    assert rollout(tmp_path, temperature=0.7, do_sample=True).default_sampling.temperature == 0.7
    raw = rollout(tmp_path, logprobs_mode="raw_logprobs").default_sampling
    assert raw.logprobs_mode is LogprobsMode.RAW
    with pytest.raises(InvalidRequest) as info:
        rollout(tmp_path, logprobs_mode="processed_logits")
    assert info.value.field == "logprobs_mode" and "processed_logprobs" in str(info.value)


def test_val_kwargs_are_the_validation_sampling(tmp_path: Path) -> None:
    config = rollout(
        tmp_path,
        response_length=64,
        val_kwargs={"_target_": "verl.workers.config.SamplingConfig", "temperature": 0.5, "do_sample": False, "n": 2},
    )
    assert config.validation_sampling is not None
    assert (config.validation_sampling.temperature, config.validation_sampling.n) == (0.0, 2)
    assert config.sampling(validation=True).max_tokens == 64
    assert config.sampling().temperature == 1.0, "validation settings stay out of the default sampling"
    with pytest.raises(InvalidRequest) as info:
        rollout(tmp_path, val_kwargs={"temprature": 0.5})
    assert info.value.field == "val_kwargs.temprature"


def test_every_no_effect_key_is_accepted_with_its_reason(tmp_path: Path) -> None:
    accepted = {
        "mode": "sync",
        "scheduling_policy": "fcfs",
        "mtp": {"enable_rollout": False},
        "enable_sleep_mode": True,
    }
    keys = {key: accepted.get(key, verl_config.ONLY_VALUES.get(key, (None,))[0]) for key in verl_config.NO_EFFECT}
    settings = read_config_file(write(tmp_path, yaml.safe_dump({"model_path": "/m", "rollout": keys})))
    noted = "\n".join(settings.notes)
    for key, reason in verl_config.NO_EFFECT.items():
        assert f"rollout.{key} has no effect here: {reason}" in noted


@pytest.mark.parametrize(
    "key,value",
    [
        ("quantization", "fp8"),
        ("qat", {"enable": True}),
        ("scheduling_policy", "priority"),
        ("limit_images", 2),
        ("mode", "remote"),
        ("mtp", {"enable_rollout": True}),
    ],
)
def test_no_effect_keys_refuse_what_rlinfer_cannot_do(tmp_path: Path, key: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        rollout(tmp_path, **{key: value})
    assert info.value.field == key


def test_routing_replay_asks_for_routed_experts(tmp_path: Path) -> None:
    assert rollout(tmp_path, enable_rollout_routing_replay=True).enable_routed_experts is True
    assert rollout(tmp_path, enable_rollout_routing_replay=False).enable_routed_experts is False


@pytest.mark.parametrize("value", ["server", "inprocess"])
def test_mode_with_an_rlinfer_value_is_the_former_name_of_serving(tmp_path: Path, value: str) -> None:
    assert rollout(tmp_path, mode=value).serving == value
    assert rollout(tmp_path, mode="async").serving == "inprocess"  # verl's mode: no effect


def test_unknown_keys_and_sections_stay_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as info:
        rollout(tmp_path, temprature=1.0)
    assert info.value.field == "temprature" and "tensor_model_parallel_size" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        read_config_file(write(tmp_path, "nosuch: {}\nrollout: {}\n"))
    assert info.value.field == "nosuch" and "trainer" in str(info.value)
    settings = read_config_file(write(tmp_path, "trainer: {nnodes: 1}\nalgorithm: {}\nrollout: {}\n"))
    assert any("['algorithm', 'trainer']" in note for note in settings.notes)


def test_two_models_in_one_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as info:
        read_config_file(write(tmp_path, "model_path: /a\nmodel: {path: /b}\nrollout: {}\n"))
    assert "two models" in str(info.value)
    with pytest.raises(InvalidRequest):
        read_config_file(write(tmp_path, "model_path: /a\nrollout: {model: /b}\n"))


def test_serving_is_rlinfers_mode_and_the_old_name_still_works(tmp_path: Path) -> None:
    assert rollout(tmp_path, serving="server", mode="async").serving == "server"
    old = EngineConfig(model="m", mode="server")
    assert old.serving == "server" and old.server_mode and old.mode is None
    assert attrs.evolve(old, mode="inprocess").serving == "inprocess"
    assert attrs.evolve(old, serving="inprocess").serving == "inprocess"
    assert engine_config(None, {"model": "m", "mode": "server"}).serving == "server", "--set mode=server"
    with pytest.raises(InvalidRequest) as info:
        EngineConfig(model="m", serving="async")  # type: ignore[arg-type]
    assert info.value.field == "serving"


def test_sampling_settings_merge_across_layers(tmp_path: Path) -> None:
    settings = read_config_file(write(tmp_path, "model_path: /m\nrollout: {temperature: 0.5, top_k: 5}\n"))
    config = engine_config(settings, {"default_sampling": {"top_k": 9}})
    assert (config.default_sampling.temperature, config.default_sampling.top_k) == (0.5, 9)
    with pytest.raises(InvalidRequest) as info:
        engine_config(settings, {"default_sampling": {"top_kk": 9}})
    assert info.value.field == "top_kk"
