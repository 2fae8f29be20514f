"""verl's config layout, read as-is: where its rollout section and model are, and what each of
its rollout keys means here.

verl (``verl/workers/config/rollout.py``: ``RolloutConfig``; defaults in
``verl/trainer/config/rollout/rollout.yaml``) describes its rollout engine in a ``rollout:``
section: at the top level (``generation.yaml``, a minimal config with ``model_path``) or under
``actor_rollout_ref`` (the trainer configs, with the model in ``actor_rollout_ref.model.path``).
Every key verl knows is either mapped onto :class:`~rlinfer_core.types.EngineConfig`
(:data:`ALIASES`, :data:`SAMPLING_KEYS`, the keys that are EngineConfig fields already) or
accepted with the reason it changes nothing here (:data:`NO_EFFECT`); a few are accepted only at
values rlinfer can honour (:data:`ONLY_VALUES`). The whole table is in docs/verl.md.

Pure data and small functions; the reading itself is :mod:`rlinfer_core.config_file`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlinfer_core.errors import InvalidRequest

#: verl's rollout key -> EngineConfig field (keys that are EngineConfig fields already are not listed)
ALIASES: Mapping[str, str] = {
    "tensor_model_parallel_size": "tensor_parallel_size",
    "pipeline_model_parallel_size": "pipeline_parallel_size",
    "free_cache_engine": "enable_memory_release",
    "prompt_length": "max_prompt_tokens",
    "response_length": "max_response_tokens",
    "full_determinism": "deterministic",
    "enable_rollout_routing_replay": "enable_routed_experts",
}

#: verl's rollout keys that set the default sampling (EngineConfig.default_sampling), by the
#: SamplingParams field they set; ``do_sample``/``logprobs_mode``/``top_k`` are translated first
SAMPLING_KEYS: Mapping[str, str] = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "n": "n",
    "do_sample": "temperature",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "logprobs_mode": "logprobs_mode",
}

#: the keys of verl's ``val_kwargs`` (its SamplingConfig) -> EngineConfig.validation_sampling
VALIDATION_SECTION = "val_kwargs"
VALIDATION_KEYS = ("temperature", "top_k", "top_p", "n", "do_sample")

#: verl's multi-turn tool loop settings -> RolloutSettings.tool_loop (rlinfer_core.tool_loop.ToolLoopConfig)
MULTI_TURN_SECTION = "multi_turn"

#: verl's logprobs_mode -> rlinfer's LogprobsMode (verl's *_logits modes return logits, which
#: rlinfer does not)
LOGPROBS_MODES: Mapping[str, str] = {"processed_logprobs": "processed", "raw_logprobs": "raw"}

#: verl's load_format -> EngineConfig.load_format (verl's older dummy_* / hf variants included)
LOAD_FORMATS: Mapping[str, str] = {
    "auto": "auto",
    "safetensors": "safetensors",
    "pt": "pt",
    "dummy": "dummy",
    "hf": "auto",
    "dummy_hf": "dummy",
    "dummy_dtensor": "dummy",
    "dummy_megatron": "dummy",
}

_TRAINER_SIDE = "a setting of verl's trainer side, not of the rollout engine"

#: verl's rollout keys accepted without effect, and why
NO_EFFECT: Mapping[str, str] = {
    "_target_": "verl's dataclass target for hydra; rlinfer builds EngineConfig",
    "mode": (
        "verl's async/sync rollout: rlinfer's engines are always driven asynchronously (AsyncEngine; "
        "Engine is its blocking wrapper), so both give the same engine; rlinfer's own in-process / "
        "server choice is `serving` (a file's `mode: inprocess|server` still sets it)"
    ),
    "calculate_log_probs": "rlinfer always returns the sampled token's logprob (Completion.logprobs)",
    "over_sample_rate": (
        "verl's agent loop aborts the rest of a batch once enough completed; with rlinfer the caller "
        "does it with engine.abort(ids)"
    ),
    "cudagraph_capture_sizes": (
        "not mapped: give the engine's own key in engine_kwargs (vLLM cudagraph_capture_sizes, "
        "SGLang cuda_graph_bs); CPU engines capture no CUDA graphs"
    ),
    "log_prob_micro_batch_size": f"{_TRAINER_SIDE} (log-prob recomputation by the actor)",
    "log_prob_micro_batch_size_per_gpu": f"{_TRAINER_SIDE} (log-prob recomputation by the actor)",
    "log_prob_use_dynamic_bsz": f"{_TRAINER_SIDE} (log-prob recomputation by the actor)",
    "log_prob_max_token_len_per_gpu": f"{_TRAINER_SIDE} (log-prob recomputation by the actor)",
    "disable_log_stats": (
        "rlinfer starts the engines with their stats logging off; its observers and rlinfer serve's "
        "/metrics report instead"
    ),
    "multi_stage_wake_up": (
        "SGLang's staged resume (weights, then KV cache): rlinfer's resume_memory(tags) resumes what "
        "the caller names, in the order it is called"
    ),
    "agent": f"{_TRAINER_SIDE} (verl's agent loop workers)",
    "trace": f"{_TRAINER_SIDE} (verl's rollout tracing)",
    "server": "verl's HTTP client settings for its SGLang server adapter; rlinfer uses request_timeout_s",
    "prometheus": "verl's Prometheus service; rlinfer serve exposes /metrics itself",
    "custom": "verl's free-form extension point, read by verl plugins only",
    "checkpoint_engine": (
        "how verl ships weights; with rlinfer the transport is chosen per update_weights call "
        "(NamedTensors, Buckets, CheckpointDir, BroadcastSource)"
    ),
    "skip_rollout": f"{_TRAINER_SIDE} (reuse of dumped rollouts)",
    "skip_dump_dir": f"{_TRAINER_SIDE} (reuse of dumped rollouts)",
    "profiler": f"{_TRAINER_SIDE} (verl's profiler)",
    "layered_summon": f"{_TRAINER_SIDE} (how FSDP gathers weights before an update)",
    "layer_name_map": f"{_TRAINER_SIDE} (weight names on the trainer side)",
    "sglang_engine_mode": "where verl places SGLang's engine; rlinfer's own choice is `serving`",
    "skip_tokenizer_init": (
        "token ids in and out is rlinfer's native path; the engines keep their tokenizer for chat "
        "requests, stop strings and text"
    ),
    "enable_sleep_mode": (
        "rlinfer starts vLLM's sleep mode (SGLang's memory saver) when free_cache_engine / "
        "enable_memory_release asks for it; enable_sleep_mode: false turns that off"
    ),
    "limit_images": "only null: rlinfer's requests are token ids or text messages",
    "quantization": "only null: rlinfer's weight updates and checksums are for unquantized models",
    "quantization_config_file": "only null: rlinfer's weight updates and checksums are for unquantized models",
    "mtp": "only without mtp.enable_rollout: rlinfer does not run speculative decoding",
    "scheduling_policy": (
        "only fcfs, the engines' default: rlinfer's requests carry no priority a priority policy could use"
    ),
    # verl 0.9's keys (verl/workers/config/rollout.py of verl 0.9.1)
    "nnodes": "verl's placement of rollout replicas; an rlinfer engine's ranks are its parallel sizes",
    "n_gpus_per_node": "verl's placement of rollout replicas; an rlinfer engine's ranks are its parallel sizes",
    "seed": (
        "verl's vLLM server seeds each request with it under full_determinism; rlinfer's requests carry "
        "their own SamplingParams.seed (the rlinfer-verl server sets it as verl does)"
    ),
    "standalone_gpu_memory_utilization": (
        "verl's memory fraction for standalone replicas; gpu_memory_utilization is used"
    ),
    "moe_tensor_parallel_size": "only 1: TensorRT-LLM's MoE tensor parallelism",
    "checkpoint_manager_class": f"{_TRAINER_SIDE} (verl's checkpoint-engine manager)",
    "moe_load_balance_metrics_interval": f"{_TRAINER_SIDE} (verl's MoE load-balance metrics)",
    "qat": "only without qat.enable: rlinfer's weight updates and checksums are for unquantized models",
    "disaggregation": "only without disaggregation.enabled: rlinfer runs no prefill/decode disaggregation",
    "router_config_path": "verl's request router between replicas; an rlinfer pool routes its own requests",
}

#: keys of NO_EFFECT that are accepted only at these values (anything else asks for something
#: rlinfer cannot do: InvalidRequest)
ONLY_VALUES: Mapping[str, tuple[Any, ...]] = {
    "limit_images": (None,),
    "quantization": (None,),
    "quantization_config_file": (None,),
    "scheduling_policy": ("fcfs", None),
    "mode": ("async", "sync"),
    "moe_tensor_parallel_size": (1, None),
}

#: every key of verl's RolloutConfig (verl 0.8 and 0.9: verl/workers/config/rollout.py) besides ``name``
VERL_ROLLOUT_KEYS: frozenset[str] = frozenset(
    {
        *ALIASES,
        *SAMPLING_KEYS,
        *NO_EFFECT,
        VALIDATION_SECTION,
        MULTI_TURN_SECTION,
        "dtype",
        "gpu_memory_utilization",
        "enforce_eager",
        "data_parallel_size",
        "expert_parallel_size",
        "max_num_batched_tokens",
        "max_model_len",
        "max_num_seqs",
        "engine_kwargs",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "load_format",
    }
)

#: top-level sections of verl's configs besides the rollout section: ignored, with a note
VERL_TOP_LEVEL: frozenset[str] = frozenset(
    {
        "actor_rollout_ref",
        "actor",
        "algorithm",
        "checkpoint",
        "critic",
        "custom_reward_function",
        "data",
        "defaults",
        "engine",
        "global_profiler",
        "hydra",
        "model",
        "model_path",
        "optim",
        "ray_kwargs",
        "ref",
        "reward_manager",
        "reward_model",
        "trainer",
        "transfer_queue",
        "ulysses_sequence_parallel_size",
        "use_remove_padding",
    }
)

#: verl's "missing value" marker (OmegaConf's MISSING): the key counts as not given
MISSING = "???"

_INTERPOLATION = re.compile(r"^\$\{(.*)\}$", re.DOTALL)


def _lookup(document: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = document
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def resolve(value: Any, document: Mapping[str, Any], section: Mapping[str, Any], key: str, depth: int = 0) -> Any:
    """``value`` with an OmegaConf interpolation that is the whole string resolved: verl's
    ``${oc.select:a.b,default}`` (the value at ``a.b`` in the file, else ``default``) and
    ``${a.b}`` / ``${.sibling}`` (a key of the file / of the same section; missing: InvalidRequest).
    Other values come back unchanged."""
    if not isinstance(value, str) or depth > 16:
        return value
    match = _INTERPOLATION.match(value.strip())
    if match is None:
        return value
    inner = match.group(1).strip()
    default: tuple[bool, Any] = (False, None)
    if inner.startswith("oc.select:"):
        path, comma, fallback = inner.removeprefix("oc.select:").partition(",")
        if comma:
            import yaml

            default = (True, yaml.safe_load(fallback.strip()) if fallback.strip() else None)
        else:
            default = (True, None)
    else:
        path = inner
    path = path.strip()
    found, target = _lookup(section, path[1:]) if path.startswith(".") else _lookup(document, path)
    if not found:
        if default[0]:
            return default[1]
        raise InvalidRequest(key, f"the interpolation {value!r} names nothing in the file")
    return resolve(target, document, section, key, depth + 1)


def sampling_value(key: str, value: Any) -> tuple[str, Any]:
    """The SamplingParams field and value one of verl's sampling keys sets."""
    if key == "do_sample":
        if not isinstance(value, bool):
            raise InvalidRequest(key, f"must be true or false, got {value!r}")
        return ("temperature", 0.0) if value is False else ("", None)  # True: temperature decides
    if key == "top_k" and value == 0:
        return "top_k", -1  # verl's "0 for HF rollout": no top-k
    if key == "logprobs_mode":
        if value not in LOGPROBS_MODES:
            raise InvalidRequest(
                key, f"must be one of {list(LOGPROBS_MODES)} (rlinfer returns logprobs, not logits), got {value!r}"
            )
        return "logprobs_mode", LOGPROBS_MODES[value]
    field = SAMPLING_KEYS[key]
    if field in _FLOAT_FIELDS and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # verl writes top_p: 1
    return field, value


_FLOAT_FIELDS = frozenset({"temperature", "top_p", "repetition_penalty"})


def sampling_fields(section: Mapping[str, Any], keys: tuple[str, ...] | Mapping[str, str]) -> dict[str, Any]:
    """SamplingParams fields from verl's sampling ``keys`` in ``section``; ``do_sample: false``
    (greedy) wins over a temperature."""
    out: dict[str, Any] = {}
    greedy = False
    for key in keys:
        if key not in section or section[key] is None:
            continue
        field, value = sampling_value(key, section[key])
        if key == "do_sample":
            greedy = field == "temperature"
            continue
        out[field] = value
    if greedy:
        out["temperature"] = 0.0
    return out


def load_format(value: Any) -> str:
    """verl's load_format as EngineConfig.load_format (InvalidRequest naming the allowed values)."""
    if value not in LOAD_FORMATS:
        raise InvalidRequest("load_format", f"must be one of {list(LOAD_FORMATS)}, got {value!r}")
    return LOAD_FORMATS[value]


def check_only_values(key: str, value: Any) -> None:
    """Refuse a value of a no-effect key that asks for something rlinfer cannot do."""
    if key in ("disaggregation", "qat"):
        flag = "enabled" if key == "disaggregation" else "enable"
        if isinstance(value, Mapping) and value.get(flag) is True:
            raise InvalidRequest(key, f"{NO_EFFECT[key]}; set {key}.{flag}: false")
        return
    if key == "mtp":
        enabled = isinstance(value, Mapping) and value.get("enable_rollout") is True
        if enabled:
            raise InvalidRequest("mtp", f"{NO_EFFECT['mtp']}; set mtp.enable_rollout: false")
        return
    if key == "enable_sleep_mode" and not isinstance(value, bool):
        raise InvalidRequest(key, f"must be true or false, got {value!r}")
    allowed = ONLY_VALUES.get(key)
    if allowed is not None and value not in allowed:
        shown = ["null" if a is None else a for a in allowed]
        raise InvalidRequest(key, f"must be one of {shown} ({NO_EFFECT[key]}), got {value!r}")
