"""The SGLang backend's cheap parts: entry point, describe(), config mapping. No engine starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from rlinfer_core import parallel
from rlinfer_core.config_file import engine_config, read_config_file
from rlinfer_core.discovery import get_backend
from rlinfer_core.errors import BackendLoadError, InvalidRequest, UnsupportedCapability
from rlinfer_core.types import Capability, EngineConfig
from rlinfer_sglang.capabilities import AGENT_CPU, COMMON, SAMPLING, capabilities
from rlinfer_sglang.config import (
    CONTEXT_RESERVE,
    CPU_DEFAULT_KV_CACHE_BYTES,
    WEIGHT_LOADER,
    kv_bytes_per_token,
    needs_context_override,
    resolve_platform,
    server_args,
)

#: verl's own config files (tests/core/data/verl, Apache-2.0, see its README)
VERL_FILES = sorted((Path(__file__).parents[2] / "core" / "data" / "verl").glob("*.yaml"))


def test_entry_point_and_describe_import_no_engine() -> None:
    code = (
        "import json, sys\n"
        "from rlinfer_core.discovery import get_backend\n"
        "caps = get_backend('sglang').describe()\n"
        "heavy = sorted(m for m in ('sglang', 'torch') if m in sys.modules)\n"
        "print(json.dumps({'caps': caps.to_dict(), 'heavy': heavy}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["caps"]["backend"] == "sglang"
    assert result["caps"]["engine_version"].startswith("sglang 0.5.")


def test_installed_engine_satisfies_declared_requirements() -> None:
    dist, version = get_backend("sglang").engine_version()
    assert dist == "sglang"
    assert version.startswith("0.5.")


def test_cpu_capabilities_are_honest() -> None:
    caps = capabilities("cpu", "sglang 0.5.23")
    assert not caps.supports(Capability.MEMORY_RELEASE)
    assert not caps.supports(Capability.SEEDED_SAMPLING)
    assert "frees nothing" in caps.notes[Capability.MEMORY_RELEASE.value]
    assert "deterministic" in caps.notes[Capability.SEEDED_SAMPLING.value]
    outputs = {Capability.GENERATE_ROUTED_EXPERTS, Capability.GENERATE_HIDDEN_STATES, Capability.MULTIMODAL}
    assert COMMON | SAMPLING | AGENT_CPU | {Capability.WEIGHTS_CHECKSUM} | outputs == caps.supported
    assert "pin_memory" in caps.notes[Capability.LORA.value], "lora: the measured reason"
    assert caps.notes[Capability.LOGPROBS_PROCESSED.value] and caps.notes[Capability.WEIGHTS_CHECKSUM.value]
    cuda = capabilities("cuda", "sglang 0.5.16")
    unverified = SAMPLING | AGENT_CPU | {Capability.WEIGHTS_CHECKSUM} | outputs
    assert not unverified & cuda.supported, "claimed only where verified"
    assert not capabilities("cpu", "sglang 0.5.23", tensor_parallel_size=2).supports(Capability.WEIGHTS_CHECKSUM)
    for pause in (Capability.PAUSE_ABORT, Capability.PAUSE_WAIT, Capability.PAUSE_KEEP):
        assert caps.notes[pause.value], "each pause mode documents its SGLang mapping"


def test_lora_is_claimed_on_cuda_only_for_an_engine_started_with_it() -> None:
    assert capabilities("cuda", "sglang 0.5.16", lora=True).supports(Capability.LORA)
    off = capabilities("cuda", "sglang 0.5.16", lora=False)
    assert not off.supports(Capability.LORA) and "enable_lora" in off.notes[Capability.LORA.value]
    assert not capabilities("cpu", "sglang 0.5.23", lora=True).supports(Capability.LORA), "pinned host tensors"


def test_cuda_graph_tag_is_not_claimed_where_it_was_measured_to_free_nothing() -> None:
    cuda = capabilities("cuda", "sglang 0.5.16", memory_release=True)
    assert not cuda.supports(Capability.MEMORY_CUDA_GRAPH)
    assert "freed 0 MiB" in cuda.notes[Capability.MEMORY_CUDA_GRAPH.value]


def test_cuda_memory_release_depends_on_the_memory_saver() -> None:
    assert capabilities("cuda", "sglang 0.5.16").supports(Capability.MEMORY_RELEASE)
    off = capabilities("cuda", "sglang 0.5.16", memory_release=False)
    assert not off.supports(Capability.MEMORY_RELEASE)
    assert "enable_memory_release=True" in off.notes[Capability.MEMORY_RELEASE.value]


def _model_dir(tmp_path: Path) -> str:
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "max_position_embeddings": 1024,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_server_args_mapping(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        seed=7,
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=1 << 26,
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
        enable_memory_release=True,
        enforce_eager=True,
        tensor_parallel_size=2,
        engine_kwargs={"chunked_prefill_size": 512, "log_level": "info"},
    )
    cpu = server_args(config, "cpu")
    assert cpu["model_path"] == cpu["tokenizer_path"] == model
    assert (cpu["dtype"], cpu["random_seed"], cpu["device"], cpu["tp_size"]) == ("bfloat16", 7, "cpu", 2)
    assert cpu["context_length"] == 256 + CONTEXT_RESERVE
    assert cpu["max_running_requests"] == 4
    # 2 (K and V) * 2 layers * 2 kv heads * 64 head dim * 2 bytes = 1 KiB per token
    assert kv_bytes_per_token(model, "bfloat16") == 1024
    assert cpu["max_total_tokens"] == (1 << 26) // 1024
    assert cpu["mem_fraction_static"] == 0.5
    assert cpu["disable_radix_cache"] is True
    assert (cpu["attention_backend"], cpu["sampling_backend"], cpu["disable_cuda_graph"]) == (
        "torch_native",
        "pytorch",
        True,
    )
    assert "enable_memory_saver" not in cpu, "SGLang's memory saver needs CUDA"
    assert cpu["chunked_prefill_size"] == 512 and cpu["log_level"] == "info", "engine_kwargs win"
    assert cpu["custom_weight_loader"] == [WEIGHT_LOADER]
    cuda = server_args(config, "cuda")
    assert cuda["enable_memory_saver"] is True and cuda["enable_weights_cpu_backup"] is True
    assert "attention_backend" not in cuda
    plain = server_args(EngineConfig(model=model), "cpu")
    assert "context_length" not in plain
    # an absolute KV budget: a start must not depend on what other processes allocate meanwhile
    assert plain["max_total_tokens"] == CPU_DEFAULT_KV_CACHE_BYTES // kv_bytes_per_token(model, "auto")
    assert "mem_fraction_static" not in plain
    assert plain["disable_cuda_graph"] is True
    unsized = server_args(EngineConfig(model=str(tmp_path / "no-config")), "cpu")
    assert unsized["mem_fraction_static"] == 0.05 and "max_total_tokens" not in unsized
    chosen = server_args(EngineConfig(model=model, engine_kwargs={"mem_fraction_static": 0.2}), "cpu")
    assert chosen["mem_fraction_static"] == 0.2 and "max_total_tokens" not in chosen


def test_engine_kwargs_keep_rlinfers_weight_loader(tmp_path: Path) -> None:
    args = server_args(EngineConfig(model=_model_dir(tmp_path), engine_kwargs={"custom_weight_loader": ["m.f"]}), "cpu")
    assert args["custom_weight_loader"] == ["m.f", WEIGHT_LOADER]


def test_kv_budget_needs_a_readable_config(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="kv_cache_memory_bytes"):
        server_args(EngineConfig(model=str(tmp_path), kv_cache_memory_bytes=1 << 26), "cpu")


def test_context_override_only_for_the_reserve(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    assert needs_context_override(EngineConfig(model=model, max_model_len=1024))
    assert needs_context_override(EngineConfig(model=model, max_model_len=1020))
    assert not needs_context_override(EngineConfig(model=model, max_model_len=512))
    assert not needs_context_override(EngineConfig(model=model, max_model_len=2048)), "too long: SGLang refuses"
    assert not needs_context_override(EngineConfig(model=model))


def test_platform_resolution() -> None:
    assert resolve_platform(EngineConfig(model="/m"), "cpu") == "cpu"
    assert resolve_platform(EngineConfig(model="/m", device="cpu"), "cuda") == "cpu"
    with pytest.raises(BackendLoadError, match="no NVIDIA GPU"):
        resolve_platform(EngineConfig(model="/m", device="cuda"), "cpu")


def test_float32_on_cuda_is_refused_up_front(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path), dtype="float32")
    with pytest.raises(InvalidRequest, match="float32"):
        server_args(config, "cuda")
    assert server_args(config, "cpu")["dtype"] == "float32"
    assert server_args(attrs.evolve(config, dtype="bfloat16"), "cuda")["dtype"] == "bfloat16"


def test_cpu_ranks_get_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinfer_core import cpu_binding
    from rlinfer_sglang import engine_env

    monkeypatch.delenv(engine_env.THREADS_BIND, raising=False)
    monkeypatch.setattr(cpu_binding, "numa_nodes", lambda: 1)
    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    two = EngineConfig(model="m", device="cpu", tensor_parallel_size=2)
    assert engine_env.engine_environment(two, "cpu")[engine_env.THREADS_BIND] == "0-1|2-3"
    assert engine_env.THREADS_BIND not in engine_env.engine_environment(EngineConfig(model="m", device="cpu"), "cpu")
    assert engine_env.THREADS_BIND not in engine_env.engine_environment(two, "cuda")
    monkeypatch.setenv(engine_env.THREADS_BIND, "5|6")  # the caller's choice wins
    assert engine_env.THREADS_BIND not in engine_env.engine_environment(two, "cpu")


def test_memory_release_on_cuda_keeps_the_weights_backup_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinfer_sglang import engine_env

    monkeypatch.delenv(engine_env.RETAIN_BACKUP, raising=False)
    releasing = EngineConfig(model="m", device="cuda", enable_memory_release=True)
    assert engine_env.engine_environment(releasing, "cuda")[engine_env.RETAIN_BACKUP] == "1"
    assert engine_env.RETAIN_BACKUP not in engine_env.engine_environment(
        attrs.evolve(releasing, enable_memory_release=False), "cuda"
    )
    assert engine_env.RETAIN_BACKUP not in engine_env.engine_environment(attrs.evolve(releasing, device="cpu"), "cpu")
    monkeypatch.setenv(engine_env.RETAIN_BACKUP, "0")  # the caller's choice wins
    assert engine_env.RETAIN_BACKUP not in engine_env.engine_environment(releasing, "cuda")


def test_attention_data_and_expert_parallel_on_cuda(tmp_path: Path) -> None:
    config = EngineConfig(
        model=_model_dir(tmp_path), tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=4
    )
    args = server_args(config, "cuda")
    assert args["tp_size"] == 4 == config.world_size, "SGLang's tp_size counts every rank"
    assert args["attn_dp_size"] == 2 and args["ep_size"] == 4, "SGLang 0.5.23 names attention DP attn_dp_size"
    assert "dp_size" not in args and "enable_dp_attention" not in args
    plain = server_args(EngineConfig(model=_model_dir(tmp_path), tensor_parallel_size=2), "cuda")
    assert plain["tp_size"] == 2 and not {"attn_dp_size", "dp_size", "ep_size"} & set(plain)


def test_attention_data_parallel_on_sglang_before_0_5_23(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rlinfer_sglang.config as mapping

    monkeypatch.setattr(mapping, "_accepts", lambda name: name != "attn_dp_size")
    args = mapping.parallel_args(EngineConfig(model="/m", data_parallel_size=2))
    assert args == {"dp_size": 2, "enable_dp_attention": True}


@pytest.mark.parametrize(
    "fields,feature,platform",
    [
        ({"data_parallel_size": 2}, parallel.DATA, "cpu"),
        ({"tensor_parallel_size": 2, "expert_parallel_size": 2}, parallel.EXPERT, "cpu"),
        ({"pipeline_parallel_size": 2}, parallel.PIPELINE, "cpu"),
        ({"pipeline_parallel_size": 2}, parallel.PIPELINE, "cuda"),
    ],
)
def test_unsupported_parallelism_is_refused_with_its_note(
    tmp_path: Path, fields: dict[str, int], feature: str, platform: str
) -> None:
    with pytest.raises(UnsupportedCapability) as info:
        server_args(EngineConfig(model=_model_dir(tmp_path), **fields), platform)  # type: ignore[arg-type]
    assert info.value.capability == feature
    assert capabilities(platform, "sglang").notes[feature] == info.value.reason  # type: ignore[arg-type]


def test_batching_and_load_format_mapping(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    args = server_args(EngineConfig(model=model, max_num_batched_tokens=4096, load_format="dummy"), "cpu")
    assert (args["max_prefill_tokens"], args["chunked_prefill_size"], args["load_format"]) == (4096, 4096, "dummy")
    off = server_args(EngineConfig(model=model, max_num_batched_tokens=4096, enable_chunked_prefill=False), "cpu")
    assert (off["max_prefill_tokens"], off["chunked_prefill_size"]) == (4096, -1)
    plain = server_args(EngineConfig(model=model), "cpu")
    assert not {"max_prefill_tokens", "chunked_prefill_size", "load_format"} & set(plain), "engine defaults"


@pytest.mark.parametrize("path", VERL_FILES, ids=lambda p: p.name)
def test_verls_example_configs_map_onto_sglang(path: Path) -> None:
    config = engine_config(read_config_file(path), defaults={"model": "/m"})
    args = server_args(config, "cuda")
    assert args["tp_size"] == config.world_size
    assert args.get("mem_fraction_static") == config.gpu_memory_utilization
    assert args.get("max_prefill_tokens") == config.max_num_batched_tokens
    assert args.get("max_running_requests") == config.max_num_seqs
    assert args.get("disable_cuda_graph", False) is config.enforce_eager
    assert args.get("load_format", "auto") == config.load_format
    assert args["custom_weight_loader"] == [WEIGHT_LOADER]


def test_routed_experts_mapping(tmp_path: Path) -> None:
    import pickle

    from rlinfer_sglang.config import WEIGHT_LOADER

    dense = _model_dir(tmp_path)
    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    (moe_dir / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2})
    )
    off = server_args(EngineConfig(model=str(moe_dir)), "cpu")
    assert "enable_return_routed_experts" not in off
    on = server_args(EngineConfig(model=str(moe_dir), enable_routed_experts=True), "cpu")
    assert on["enable_return_routed_experts"] is True
    (loader,) = on["custom_weight_loader"]
    assert loader == WEIGHT_LOADER and type(pickle.loads(pickle.dumps(loader))) is str
    assert "enable_return_routed_experts" not in server_args(
        EngineConfig(model=dense, enable_routed_experts=True), "cpu"
    )


def test_images_are_claimed_for_a_model_with_an_image_token_only(tmp_path: Path) -> None:
    """generate.multimodal: dropped at start for a text model (no image_token_id), kept for a VLM;
    on CUDA not claimed (the kit has not run there), with the reason."""
    from rlinfer_sglang.capabilities import multimodal_off

    text, vlm = tmp_path / "text", tmp_path / "vlm"
    text.mkdir()
    vlm.mkdir()
    (text / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (vlm / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"], "image_token_id": 5})
    )
    assert "text-only" in multimodal_off(str(text))[Capability.MULTIMODAL]
    assert multimodal_off(str(vlm)) == {}
    cuda = capabilities("cuda", "sglang 0.5.16")
    assert not cuda.supports(Capability.MULTIMODAL) and "not run on a GPU" in cuda.notes[Capability.MULTIMODAL.value]


def test_images_go_to_sglang_as_one_image_token_each_with_data_urls(tmp_path: Path) -> None:
    """rlinfer_sglang.images.engine_input: the expanded prompt collapsed to one image token per
    image (SGLang expands it; it does not recognise an expanded run) plus image_data; a batched
    server body gives samples without images ``image_data: []``."""
    import numpy as np

    from rlinfer_core.types import GenerateRequest
    from rlinfer_sglang.images import engine_input
    from rlinfer_sglang.requests import batch_body

    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 5}))
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    request = GenerateRequest(prompt_token_ids=[1, 5, 5, 5, 2], images=[image])
    sent = engine_input(str(tmp_path), request, [1, 5, 5, 5, 2])
    assert sent["input_ids"] == [1, 5, 2]
    assert [url[:22] for url in sent["image_data"]] == ["data:image/png;base64,"]
    plain = GenerateRequest(prompt_token_ids=[1, 5, 2])
    assert engine_input(str(tmp_path), plain, [1, 5, 2]) == {"input_ids": [1, 5, 2]}
    body = batch_body([{"input_ids": [1, 2], "rid": "a"}, {**sent, "rid": "b"}])
    assert body["input_ids"] == [[1, 2], [1, 5, 2]] and body["image_data"] == [[], sent["image_data"]]
