"""What the facade checks before a backend sees anything: the capabilities a request or a weight
transport needs, request limits, memory tags. Pure functions; no engine, no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, assert_never

from rlinfer_core.errors import EngineOutOfMemory, InvalidRequest, WeightUpdateError
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.structured import StructuredKind
from rlinfer_core.types import (
    BASE_MEMORY_TAGS,
    PAUSE_CAPABILITY,
    Capabilities,
    Capability,
    EngineConfig,
    GenerateRequest,
    LogprobsMode,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import (
    BroadcastSource,
    Buckets,
    CheckpointDir,
    NamedTensors,
    WeightSource,
    WeightUpdate,
)


def transport_capability(source: WeightSource) -> Capability:
    """The capability a weight source's transport needs (a new transport is a type error here)."""
    match source:
        case NamedTensors():
            return Capability.WEIGHTS_TENSORS
        case Buckets():
            return Capability.WEIGHTS_BUCKETS
        case CheckpointDir():
            return Capability.WEIGHTS_DISK
        case BroadcastSource():
            return Capability.WEIGHTS_BROADCAST
        case _:
            assert_never(source)


#: the same, by type (for callers that hold a type rather than a source)
TRANSPORT_CAPABILITY: Mapping[type, Capability] = {
    NamedTensors: Capability.WEIGHTS_TENSORS,
    Buckets: Capability.WEIGHTS_BUCKETS,
    CheckpointDir: Capability.WEIGHTS_DISK,
    BroadcastSource: Capability.WEIGHTS_BROADCAST,
}


def transport_name(source: WeightSource) -> str:
    """Short name of a weight source's transport ("tensors", "buckets", "disk", "broadcast")."""
    return transport_capability(source).value.removeprefix("weights.")


def request_capabilities(request: GenerateRequest) -> list[Capability]:
    """The capabilities a request needs beyond plain generation."""
    s = request.sampling
    needed = []
    if request.messages is not None:
        needed.append(Capability.CHAT)
    if s.prompt_logprobs:
        needed.append(Capability.PROMPT_LOGPROBS)
    if s.logprobs or s.prompt_top_logprobs:
        needed.append(Capability.TOP_LOGPROBS)
    if s.n > 1:
        needed.append(Capability.MULTI_SAMPLE)
    if s.seed is not None and not s.greedy:
        needed.append(Capability.SEEDED_SAMPLING)
    if s.stop:
        needed.append(Capability.STOP_STRINGS)
    if s.stop_regex:
        needed.append(Capability.STOP_REGEX)
    if s.structured is not None and s.structured.kind is StructuredKind.EBNF:
        needed.append(Capability.GRAMMAR_EBNF)  # generate.structured: agent_request_capabilities
    if request.priority != 0:
        needed.append(Capability.PRIORITY)
    if request.all_images:
        needed.append(Capability.MULTIMODAL)
    if s.min_p > 0.0:
        needed.append(Capability.SAMPLING_MIN_P)
    if s.penalised:
        needed.append(Capability.SAMPLING_PENALTIES)
    if s.biased:
        needed.append(Capability.SAMPLING_LOGIT_BIAS)
    if s.return_routed_experts:
        needed.append(Capability.GENERATE_ROUTED_EXPERTS)
    if s.return_hidden_states:
        needed.append(Capability.GENERATE_HIDDEN_STATES)
    if s.logprobs_mode is LogprobsMode.RAW:
        needed.append(Capability.LOGPROBS_RAW)
    elif s.truncates and not s.greedy:
        needed.append(Capability.LOGPROBS_PROCESSED)
    return needed


def releasable_memory_tags(capabilities: Capabilities) -> frozenset[MemoryTag]:
    """What ``release_memory()`` without tags acts on: weights and KV cache, and the CUDA graphs'
    memory where the engine claims ``memory.cuda_graph``."""
    if capabilities.supports(Capability.MEMORY_CUDA_GRAPH):
        return BASE_MEMORY_TAGS | {MemoryTag.CUDA_GRAPH}
    return BASE_MEMORY_TAGS


def as_memory_tags(
    tags: Iterable[MemoryTag | str] | MemoryTag | str | None, capabilities: Capabilities
) -> frozenset[MemoryTag]:
    """Normalise tags; ``None`` means every tag the engine can release. Raises
    UnsupportedCapability for ``cuda_graph`` where the engine does not claim it."""
    if tags is None:
        return releasable_memory_tags(capabilities)
    if isinstance(tags, str):
        tags = [tags]
    out = set()
    for tag in tags:
        try:
            out.add(MemoryTag(tag))
        except ValueError:
            raise InvalidRequest("tags", f"must be among {[t.value for t in MemoryTag]}, got {tag!r}") from None
    if not out:
        raise InvalidRequest("tags", "must name at least one memory tag")
    if MemoryTag.CUDA_GRAPH in out:
        capabilities.require(Capability.MEMORY_CUDA_GRAPH)
    return frozenset(out)


def validate_request(
    request: GenerateRequest,
    capabilities: Capabilities,
    released: Iterable[MemoryTag],
    info: ModelInfo | None,
) -> None:
    """Raise UnsupportedCapability / InvalidRequest unless the engine can serve ``request`` now."""
    if not isinstance(request, GenerateRequest):
        raise InvalidRequest("requests", f"must be GenerateRequest objects, got {type(request).__name__}")
    for capability in request_capabilities(request):
        capabilities.require(capability)
    released = frozenset(released)
    if MemoryTag.KV_CACHE in released or MemoryTag.WEIGHTS in released:
        raise InvalidRequest("engine_state", f"memory {sorted(released)} is released; call resume_memory() first")
    if info is None or request.prompt_token_ids is None:
        return
    for i, token in enumerate(request.prompt_token_ids):
        if token >= info.vocab_size:
            raise InvalidRequest("prompt_token_ids", f"item {i} must be < vocab_size ({info.vocab_size}), got {token}")
    sampling = request.sampling
    for field, tokens in (
        ("stop_token_ids", sampling.stop_token_ids),
        ("logit_bias", [t for t, _ in sampling.logit_bias]),
        ("allowed_token_ids", sampling.allowed_token_ids or ()),
    ):
        for token in tokens:
            if token >= info.vocab_size:
                raise InvalidRequest(field, f"token ids must be < vocab_size ({info.vocab_size}), got {token}")
    if len(request.prompt_token_ids) >= info.max_model_len:
        raise InvalidRequest(
            "prompt_token_ids",
            f"prompt of {len(request.prompt_token_ids)} tokens must be shorter than "
            f"max_model_len ({info.max_model_len})",
        )
    check_kv_room(len(request.prompt_token_ids), sampling.max_tokens, info)


def check_kv_room(prompt_tokens: int, max_tokens: int, info: ModelInfo) -> None:
    """Raise a non-transient EngineOutOfMemory when a request of ``prompt_tokens`` asking for
    ``max_tokens`` (capped at the context, where generation stops anyway) cannot fit the engine's
    KV cache even alone (``info.kv_capacity_tokens``; nothing to check where it is None)."""
    capacity = info.kv_capacity_tokens
    needed = min(prompt_tokens + max_tokens, info.max_model_len)
    if capacity is not None and needed > capacity:
        raise EngineOutOfMemory(
            f"a request of {prompt_tokens} prompt tokens and max_tokens={max_tokens} needs {needed} tokens of "
            f"KV cache; this engine's KV cache holds at most {capacity} tokens for one request (below "
            f"max_model_len {info.max_model_len}): shorten the request or start the engine with a larger "
            "kv_cache_memory_bytes",
            transient=False,
            needed_tokens=needed,
            capacity_tokens=capacity,
        )


def check_config_limits(request: GenerateRequest, config: EngineConfig) -> None:
    """Raise InvalidRequest when ``request`` exceeds the config's request limits:
    ``max_response_tokens`` (its max_tokens) and ``max_prompt_tokens`` (a token-id prompt's
    length; a chat prompt's length is known only once templated, and is not checked here)."""
    limit = config.max_response_tokens
    if limit is not None and request.sampling.max_tokens > limit:
        raise InvalidRequest(
            "max_tokens",
            f"must be <= max_response_tokens ({limit}) of the engine's config, got {request.sampling.max_tokens}",
        )
    limit = config.max_prompt_tokens
    if limit is not None and request.prompt_token_ids is not None and len(request.prompt_token_ids) > limit:
        raise InvalidRequest(
            "prompt_token_ids",
            f"prompt of {len(request.prompt_token_ids)} tokens must be at most max_prompt_tokens ({limit}) "
            "of the engine's config",
        )


def pause_mode(mode: PauseMode | str, capabilities: Capabilities) -> PauseMode:
    """``mode`` as a PauseMode the engine supports (InvalidRequest / UnsupportedCapability otherwise)."""
    try:
        pause = PauseMode(mode)
    except ValueError:
        raise InvalidRequest("mode", f"must be one of {[m.value for m in PauseMode]}, got {mode!r}") from None
    capabilities.require(PAUSE_CAPABILITY[pause])
    return pause


def as_weight_update(update: WeightUpdate | WeightSource | Mapping[str, Any], version: int | None) -> WeightUpdate:
    """A WeightUpdate from what ``update_weights`` accepts: an update, a source, or ``{name: tensor}``."""
    if isinstance(update, Mapping):
        update = NamedTensors.of(dict(update))
    if not isinstance(update, WeightUpdate):
        update = WeightUpdate(update, version=version)
    return update


def update_target(update: WeightUpdate, current: int, capabilities: Capabilities, released: Iterable[MemoryTag]) -> int:
    """The version ``update`` will take; raises before anything is touched when it cannot be loaded
    now (transport not supported, version not newer, weights released)."""
    capabilities.require(transport_capability(update.source))
    target = current + 1 if update.version is None else update.version
    if target <= current:
        raise WeightUpdateError(f"version {target} must be greater than the current version {current}")
    if MemoryTag.WEIGHTS in frozenset(released):
        raise WeightUpdateError("weights are released; call resume_memory(['weights']) first")
    return target


def as_batch(
    requests: GenerateRequest | Sequence[GenerateRequest], check: Callable[[GenerateRequest], None]
) -> list[GenerateRequest]:
    """The batch ``generate`` was given, each request passed through ``check``, ids unique."""
    batch = [requests] if isinstance(requests, GenerateRequest) else list(requests)
    for request in batch:
        check(request)
    if len({r.request_id for r in batch}) != len(batch):
        raise InvalidRequest("request_id", "request ids in one batch must be unique")
    return batch
