"""Map rlinfer's :class:`EngineConfig` onto SGLang ``ServerArgs`` keyword arguments.

Pure functions over plain data (no SGLang import), so the mapping is unit-testable anywhere.

=============================  ===============================================================
EngineConfig                   SGLang ServerArgs
=============================  ===============================================================
model / tokenizer              model_path / tokenizer_path
dtype                          dtype ("auto", "float32", "bfloat16", "float16")
seed                           random_seed
device                         device ("cpu" / "cuda"; "auto" = the platform found)
tensor_parallel_size x         tp_size (SGLang's tp_size counts every rank of a pipeline stage)
  data_parallel_size
data_parallel_size > 1         attn_dp_size (dp_size + enable_dp_attention before SGLang 0.5.23)
expert_parallel_size > 1       ep_size
pipeline_parallel_size > 1     refused: UnsupportedCapability (see capabilities.PARALLEL_UNSUPPORTED)
load_format (not "auto")       load_format
max_num_batched_tokens         max_prefill_tokens, and chunked_prefill_size unless chunking is off
enable_chunked_prefill=False   chunked_prefill_size=-1
max_model_len                  context_length = max_model_len + 5 (SGLang's reserve, below)
max_num_seqs                   max_running_requests
kv_cache_memory_bytes          max_total_tokens (bytes / KV bytes per token of the model)
gpu_memory_utilization         mem_fraction_static
enable_prefix_caching=False    disable_radix_cache=True
enable_memory_release (CUDA)   enable_memory_saver=True, enable_weights_cpu_backup=True
enforce_eager                  disable_cuda_graph=True
deterministic                  enable_deterministic_inference=True
enable_routed_experts (MoE)    enable_return_routed_experts=True (on CPU: see cpu_routes)
enable_hidden_states           enable_return_hidden_states=True
engine_kwargs                  passed through unchanged (they win)
=============================  ===============================================================

On CUDA, ``dtype="float32"`` is refused (InvalidRequest): sgl_kernel's RMSNorm has no float32
kernel and the scheduler would die at start (seen with SGLang 0.5.16 on an H200).

On CPU the backend also sets SGLang's native PyTorch paths: ``attention_backend="torch_native"``,
``sampling_backend="pytorch"``, ``disable_cuda_graph=True`` and, without a KV budget, an absolute
one of ``CPU_DEFAULT_KV_CACHE_BYTES`` (``max_total_tokens``): SGLang's fraction of host memory is
measured against what is free before and after loading the weights, so a neighbour allocating
memory meanwhile made a start fail ("Loaded weights leave no GPU memory for the KV cache"); the
fraction (``mem_fraction_static=0.05``) is left only where the KV bytes per token are unknown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlinfer_core import parallel
from rlinfer_core.errors import BackendLoadError, InvalidRequest
from rlinfer_core.kv_budget import hf_text_config
from rlinfer_core.kv_budget import kv_bytes_per_token as kv_bytes_per_token
from rlinfer_core.routing import moe_shape
from rlinfer_core.types import EngineConfig
from rlinfer_sglang.capabilities import BACKEND, PARALLEL_UNSUPPORTED, Platform

#: the scheduler-side loader (see rlinfer_sglang.scheduler.loader) every engine is started with
WEIGHT_LOADER = "rlinfer_sglang.scheduler.loader.load"

CPU_DEFAULT_MEM_FRACTION = 0.05
#: the KV cache of a CPU engine started without kv_cache_memory_bytes (see the module docstring)
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30

#: SGLang accepts prompts of at most context_length - 6 tokens (it keeps positions in reserve);
#: rlinfer's max_model_len means "prompt + output <= max_model_len", so SGLang gets this much more
#: context and rlinfer clips every request's output to max_model_len itself
CONTEXT_RESERVE = 5

#: the model's config.json, its text part (rlinfer_core.kv_budget)
_hf_config = hf_text_config


def resolve_platform(config: EngineConfig, found: Platform) -> Platform:
    """The platform the engine runs on: ``config.device`` unless "auto"."""
    if config.device == "auto":
        return found
    if config.device == "cuda" and found == "cpu":
        raise BackendLoadError("EngineConfig.device='cuda' but no NVIDIA GPU is visible to SGLang here")
    return config.device


def needs_context_override(config: EngineConfig) -> bool:
    """True when only SGLang's reserve (not max_model_len) exceeds the model's context length.

    SGLang then needs ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1`` at start; the reserved
    positions are never used because rlinfer clips requests to ``max_model_len``.
    """
    if config.max_model_len is None:
        return False
    cfg = _hf_config(config.model) or {}
    limit = cfg.get("max_position_embeddings")
    return isinstance(limit, int) and config.max_model_len <= limit < config.max_model_len + CONTEXT_RESERVE


def _accepts(name: str) -> bool:
    """Whether the installed SGLang's ServerArgs has the field ``name`` (it grows by release)."""
    import inspect

    from sglang.srt.server_args import ServerArgs

    return name in inspect.signature(ServerArgs).parameters  # a dataclass or a msgspec Struct


#: model classes SGLang cannot run on a platform, and why (found by the kit's architecture sweep)
UNSERVABLE_ARCHITECTURES: dict[Platform, dict[str, str]] = {
    "cpu": {
        "Qwen2MoeForCausalLM": (
            "SGLang 0.5.23's Qwen2-MoE gates its shared expert with a Triton-only kernel "
            "(fused_gate_sigmoid_mul_add) that has no CPU driver: the scheduler dies at the first "
            "forward pass"
        ),
    },
    "cuda": {},
}


def refuse_unservable_architecture(model: str, platform: Platform) -> None:
    """UnsupportedCapability (``generate``) for a model whose class SGLang cannot run here."""

    from rlinfer_core.errors import UnsupportedCapability

    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return  # a hub id or an unusual layout: SGLang reads it and reports for itself
    for architecture in json.loads(config_file.read_text()).get("architectures") or ():
        reason = UNSERVABLE_ARCHITECTURES[platform].get(architecture)
        if reason is not None:
            raise UnsupportedCapability("generate", BACKEND, f"{architecture} on {platform}: {reason}")


def server_args(config: EngineConfig, platform: Platform) -> dict[str, Any]:
    """SGLang ``Engine(**kwargs)`` arguments for ``config`` on ``platform``."""
    if platform == "cuda" and config.dtype == "float32":
        # else the scheduler dies at start: "rmsnorm ... failed to dispatch data type Float"
        raise InvalidRequest(
            "dtype", "SGLang's CUDA kernels (sgl_kernel's RMSNorm) have no float32: use bfloat16 or float16"
        )
    parallel.refuse_unsupported(config, BACKEND, PARALLEL_UNSUPPORTED[platform])
    refuse_unservable_architecture(config.model, platform)
    args: dict[str, Any] = {
        "model_path": config.model,
        "tokenizer_path": config.tokenizer or config.model,
        "dtype": config.dtype,
        "random_seed": config.seed,
        "device": platform,
        "tp_size": config.tensor_parallel_size * config.data_parallel_size,
        "log_level": "error",
        "custom_weight_loader": [WEIGHT_LOADER],
        # rlinfer's logits processor (penalties, logit_bias, allowed_token_ids; see logits.py)
        "enable_custom_logit_processor": True,
        # compact JSON under a json_schema constraint (xgrammar), as the vLLM backend does
        "constrained_json_disable_any_whitespace": True,
    }
    vocab = (_hf_config(config.model) or {}).get("vocab_size")
    if isinstance(vocab, int) and vocab > 0 and _accepts("sampling_mask_max_tokens"):
        # SGLang aborts a request whose sampling support is larger than this; the whole
        # vocabulary fits, so truncated processed logprobs never abort a request
        # (absent in SGLang 0.5.16, where processed logprobs under truncation are not claimed)
        args["sampling_mask_max_tokens"] = vocab
    args.update(parallel_args(config))
    args.update(batching_args(config))
    if config.load_format != "auto":
        args["load_format"] = config.load_format
    if config.max_model_len is not None:
        args["context_length"] = config.max_model_len + CONTEXT_RESERVE
    if config.max_num_seqs is not None:
        args["max_running_requests"] = config.max_num_seqs
    if config.kv_cache_memory_bytes is not None:
        per_token = kv_bytes_per_token(config.model, config.dtype)
        if per_token is None:
            raise InvalidRequest(
                "kv_cache_memory_bytes",
                f"cannot size the KV cache of {config.model!r} (no readable config.json); "
                "pass engine_kwargs={'max_total_tokens': N} instead",
            )
        args["max_total_tokens"] = max(config.kv_cache_memory_bytes // per_token, 256)
    if config.gpu_memory_utilization is not None:
        args["mem_fraction_static"] = config.gpu_memory_utilization
    if not config.enable_prefix_caching:
        args["disable_radix_cache"] = True
    if config.enforce_eager:
        args["disable_cuda_graph"] = True
    if config.deterministic:
        args["enable_deterministic_inference"] = True
    if config.priority_scheduling:
        args["enable_priority_scheduling"] = True
    if platform == "cpu":
        args.update(
            attention_backend="torch_native",
            sampling_backend="pytorch",
            disable_cuda_graph=True,
            # the overlap scheduler runs the next step before output_ids holds the last token,
            # which rlinfer's penalties read (see logits.py); little to gain on CPU anyway
            disable_overlap_schedule=True,
            # an idle scheduler otherwise spins a whole core, which on CPU is the model's own
            sleep_on_idle=True,
        )
        if not {"max_total_tokens", "mem_fraction_static"} & (set(args) | set(config.engine_kwargs)):
            per_token = kv_bytes_per_token(config.model, config.dtype)
            if per_token is not None:
                args["max_total_tokens"] = max(CPU_DEFAULT_KV_CACHE_BYTES // per_token, 256)
            else:
                args["mem_fraction_static"] = CPU_DEFAULT_MEM_FRACTION
    elif config.enable_memory_release:
        # without the CPU backup SGLang's resumed weights are garbage (measured on H100)
        args.update(enable_memory_saver=True, enable_weights_cpu_backup=True)
    routes = config.enable_routed_experts and moe_shape(config.model) is not None
    if routes:
        args["enable_return_routed_experts"] = True
    if config.enable_hidden_states:
        args["enable_return_hidden_states"] = True
    args.update(config.engine_kwargs)
    loaders = list(args.get("custom_weight_loader") or [])
    if WEIGHT_LOADER not in loaders:
        loaders.append(WEIGHT_LOADER)
    if routes and platform == "cpu":
        from rlinfer_sglang.scheduler.cpu_routes import LoaderName

        loaders = [LoaderName(name) if name == WEIGHT_LOADER else name for name in loaders]
    args["custom_weight_loader"] = loaders
    return args


def parallel_args(config: EngineConfig) -> dict[str, Any]:
    """SGLang's attention data parallelism and expert parallelism for ``config`` (tp_size is set
    by :func:`server_args`: tensor x data parallel size)."""
    args: dict[str, Any] = {}
    if config.data_parallel_size > 1:
        if _accepts("attn_dp_size"):
            args["attn_dp_size"] = config.data_parallel_size
        else:  # SGLang before 0.5.23
            args.update(dp_size=config.data_parallel_size, enable_dp_attention=True)
    if config.expert_parallel_size > 1:
        args["ep_size"] = config.expert_parallel_size
    return args


def batching_args(config: EngineConfig) -> dict[str, Any]:
    """SGLang's prefill batching for ``max_num_batched_tokens`` / ``enable_chunked_prefill``."""
    args: dict[str, Any] = {}
    if config.max_num_batched_tokens is not None:
        args["max_prefill_tokens"] = config.max_num_batched_tokens
        if config.enable_chunked_prefill is not False:
            args["chunked_prefill_size"] = config.max_num_batched_tokens
    if config.enable_chunked_prefill is False:
        args["chunked_prefill_size"] = -1
    return args
