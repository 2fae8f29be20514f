"""The contract's data types: frozen attrs classes, validated where they are built.

Invalid values raise :class:`~rlinfer_core.errors.InvalidRequest` naming the field and its
allowed range, so a bad request never reaches an engine.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from rlinfer_core import _validate as v
from rlinfer_core.assignments import parse_assignments as parse_assignments
from rlinfer_core.capability import Capabilities as Capabilities
from rlinfer_core.capability import Capability as Capability
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.hidden_states import HiddenStates
from rlinfer_core.multimodal import (
    ContentPart,
    Image,
    MultiModalInfo,
    content_images,
    template_content,
    to_content,
    to_images,
)
from rlinfer_core.routing import RoutedExperts
from rlinfer_core.sampling import MAX_N as MAX_N
from rlinfer_core.sampling import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS
from rlinfer_core.sampling import LogprobsMode as LogprobsMode
from rlinfer_core.sampling import SamplingParams as SamplingParams
from rlinfer_core.tools import ToolCalls, ToolSpec, check_parser, to_tools


class FinishReason(enum.StrEnum):
    """Why a completion ended."""

    STOP = "stop"  #: EOS, a stop token id or a stop string
    LENGTH = "length"  #: max_tokens or the model's context length
    ABORT = "abort"  #: aborted by the caller (abort or pause(mode=ABORT))


class MemoryTag(enum.StrEnum):
    """What ``release_memory``/``resume_memory`` act on."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    #: the memory of captured CUDA graphs (capability ``memory.cuda_graph``)
    CUDA_GRAPH = "cuda_graph"


ALL_MEMORY_TAGS: frozenset[MemoryTag] = frozenset(MemoryTag)
#: what every engine with ``memory.release`` can release
BASE_MEMORY_TAGS: frozenset[MemoryTag] = frozenset({MemoryTag.WEIGHTS, MemoryTag.KV_CACHE})


class PauseMode(enum.StrEnum):
    """What happens to in-flight requests when generation is paused.

    ABORT: they end now with finish_reason "abort" and their partial tokens.
    WAIT: pause returns once they have all finished; new requests queue until resume.
    KEEP: they are frozen with their KV cache and continue after resume (with whatever weights
    are loaded by then).
    """

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


PAUSE_CAPABILITY: Mapping[PauseMode, Capability] = {
    PauseMode.ABORT: Capability.PAUSE_ABORT,
    PauseMode.WAIT: Capability.PAUSE_WAIT,
    PauseMode.KEEP: Capability.PAUSE_KEEP,
}


def _message_content(value: Any) -> str | tuple[ContentPart, ...]:
    return to_content(value, "a message")


@attrs.frozen
class ChatMessage:
    """One chat turn; the engine applies the model's chat template. ``content`` is a string, or
    a list of text and image parts (OpenAI's shapes, see :mod:`rlinfer_core.multimodal`)."""

    role: str = attrs.field(validator=v.one_of("system", "user", "assistant", "tool"))
    content: str | tuple[ContentPart, ...] = attrs.field(converter=_message_content)

    @property
    def images(self) -> tuple[Image, ...]:
        """The image parts' images, in order."""
        return content_images(self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it (image parts as ``{"type": "image"}``)."""
        return {"role": self.role, "content": template_content(self.content)}


def _new_request_id() -> str:
    return uuid.uuid4().hex


#: a fresh request id (what GenerateRequest uses by default)
new_request_id = _new_request_id


def _check_lora_name(_inst: Any, _attribute: Any, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidRequest("lora", f"must be a loaded adapter's name or None, got {value!r}")


def _to_messages(value: Any) -> tuple[ChatMessage, ...] | None:
    if value is None:
        return None
    out = []
    for i, m in enumerate(value):
        if isinstance(m, ChatMessage):
            out.append(m)
        elif isinstance(m, Mapping) and set(m) == {"role", "content"}:
            out.append(ChatMessage(role=m["role"], content=m["content"]))
        else:
            raise InvalidRequest("messages", f"item {i} must be {{'role','content'}}, got {m!r}")
    return tuple(out)


def _to_token_ids(value: Any) -> tuple[int, ...] | None:
    return None if value is None else v.to_tuple(value)


@attrs.frozen
class GenerateRequest:
    """One prompt to complete: token ids, or chat messages (exactly one of the two)."""

    prompt_token_ids: tuple[int, ...] | None = attrs.field(
        default=None,
        converter=_to_token_ids,
        validator=attrs.validators.optional(v.int_items()),
    )
    messages: tuple[ChatMessage, ...] | None = attrs.field(default=None, converter=_to_messages)
    sampling: SamplingParams = attrs.field(
        factory=SamplingParams, validator=v.instance_of(SamplingParams, "a SamplingParams")
    )
    request_id: str = attrs.field(factory=_new_request_id)
    #: tools the model may call (capability generate.tools): rendered into the chat template's tool
    #: section for ``messages`` requests, and used to check parsed calls
    tools: tuple[ToolSpec, ...] | None = attrs.field(default=None, converter=to_tools)
    #: parse tool calls in the output with this format ("hermes", "qwen", "llama"); sets
    #: Completion.tool_calls (capability generate.tools)
    tool_parser: str | None = attrs.field(default=None, validator=lambda _i, _a, value: check_parser(value))
    #: generate with this loaded LoRA adapter (capability lora); None: the base weights
    lora: str | None = attrs.field(default=None, validator=_check_lora_name)
    #: scheduling priority, lower served first (vLLM's order; rlinfer flips it for SGLang): where
    #: the engine queues requests, a lower value is admitted (and may preempt) first. Any value
    #: but 0 needs capability generate.priority (an engine started with priority scheduling)
    priority: int = attrs.field(default=0, validator=v.in_range(-(2**31), 2**31 - 1, integer=True))
    #: images of a prompt_token_ids request, in the order of the image placeholders in the ids
    #: (capability generate.multimodal; :mod:`rlinfer_core.multimodal`); a messages request
    #: carries its images as image parts of the messages instead
    images: tuple[Image, ...] = attrs.field(default=(), converter=to_images)

    @property
    def all_images(self) -> tuple[Image, ...]:
        """The request's images in prompt order: ``images``, or the messages' image parts."""
        if self.messages is None:
            return self.images
        return tuple(image for m in self.messages for image in m.images)

    def __attrs_post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.messages is None):
            raise InvalidRequest("prompt_token_ids", "give exactly one of prompt_token_ids or messages")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise InvalidRequest("prompt_token_ids", "must hold at least one token id")
        if self.messages is not None and not self.messages:
            raise InvalidRequest("messages", "must hold at least one message")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequest("request_id", f"must be a non-empty string, got {self.request_id!r}")
        if self.messages is not None and self.images:
            raise InvalidRequest("images", "a messages request carries its images as image parts of the messages")


@attrs.frozen
class Completion:
    """One finished sample. ``logprobs[i]`` is the logprob of ``token_ids[i]`` (see
    :class:`LogprobsMode`); ``token_versions[i]`` is the weight version that produced
    ``token_ids[i]``; ``weight_version`` is the newest of them (the version served at the end).

    A weight update while a request runs (paused with ``pause(mode="keep")`` or not) changes the
    weights from the next engine step on: tokens before it carry the old version, tokens after it
    the new one.
    """

    request_id: str
    index: int  #: sample index in [0, n)
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    stop_reason: int | str | None = None  #: the stop token id or stop string that matched
    top_logprobs: tuple[Mapping[int, float], ...] | None = None
    #: logprob of each prompt token given the ones before it; the first is None
    prompt_logprobs: tuple[float | None, ...] | None = None
    #: the ``prompt_top_logprobs`` most likely tokens at each prompt position; the first is None
    prompt_top_logprobs: tuple[Mapping[int, float] | None, ...] | None = None
    weight_version: int = 0
    text: str | None = None  #: detokenized output when the engine has a tokenizer
    latency_s: float | None = None
    token_versions: tuple[int, ...] | None = None  #: per token; filled for every completion
    #: tool calls parsed from the output when the request named a ``tool_parser`` (token_ids stay raw)
    tool_calls: ToolCalls | None = None
    #: [prompt + completion tokens, layers, top_k] expert ids when the request asked for them
    #: (SamplingParams.return_routed_experts); alignment and sentinel: :mod:`rlinfer_core.routing`
    routed_experts: RoutedExperts | None = None
    #: [completion tokens, hidden] final-layer states that produced each token, and [prompt
    #: tokens, hidden] per prompt position (SamplingParams.return_hidden_states /
    #: prompt_hidden_states); alignment: :mod:`rlinfer_core.hidden_states`
    hidden_states: HiddenStates | None = None
    prompt_hidden_states: HiddenStates | None = None
    #: where the request's images sit in ``prompt_token_ids`` (expanded exactly once) and the
    #: processor's metadata a trainer needs to rebuild the model inputs; None without images
    multimodal: MultiModalInfo | None = None


@attrs.frozen
class CompletionDelta:
    """A streaming increment of one sample; concatenating all deltas gives the Completion."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None = None  #: set on the last delta only
    stop_reason: int | str | None = None
    weight_version: int = 0
    token_versions: tuple[int, ...] | None = None  #: per token of this delta


Dtype = Literal["auto", "float32", "bfloat16", "float16"]


#: ``EngineConfig.load_format`` and ``EngineConfig.serving`` values (see the fields)
LoadFormat = Literal["auto", "safetensors", "pt", "dummy"]
Serving = Literal["inprocess", "server"]


def _to_sampling(value: Any) -> Any:
    """A mapping of SamplingParams fields (a config file's, JSON's) as SamplingParams."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {f.name for f in attrs.fields(SamplingParams)})
        if unknown:
            raise InvalidRequest(
                str(unknown[0]),
                f"not a SamplingParams field; allowed: {[f.name for f in attrs.fields(SamplingParams)]}",
            )
        return SamplingParams(**value)
    return value


def _check_sampling(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if attribute.name == "validation_sampling" and value is None:
        return
    if not isinstance(value, SamplingParams):
        raise InvalidRequest(attribute.name, f"must be a SamplingParams, got {type(value).__name__}")


@attrs.frozen
class EngineConfig:
    """One schema for every engine; each backend maps it onto its engine's own arguments.

    ``engine_kwargs`` passes engine-specific arguments through unchanged (they win).

    Parallelism (verl's and vLLM's words): an engine runs on ``world_size`` = tensor x data x
    pipeline parallel sizes ranks; tensor ranks shard each layer, data-parallel copies of that
    group run their own batches inside one engine; ``expert_parallel_size`` is 1 (experts sharded
    like the other layers) or tensor x data (each rank holds whole experts).
    """

    model: str = attrs.field(validator=v.instance_of(str, "a string"))
    tokenizer: str | None = None
    dtype: Dtype = attrs.field(default="auto", validator=v.one_of("auto", "float32", "bfloat16", "float16"))
    seed: int = attrs.field(default=0, validator=v.in_range(0, 2**31 - 1, integer=True))
    device: Literal["auto", "cpu", "cuda"] = attrs.field(default="auto", validator=v.one_of("auto", "cpu", "cuda"))
    tensor_parallel_size: int = attrs.field(default=1, validator=v.in_range(1, 1024, integer=True))
    #: copies of the tensor-parallel group inside one engine, each with its own requests (see the
    #: class docstring); a pool of separate engines is an rlinfer-ray pool instead
    data_parallel_size: int = attrs.field(default=1, validator=v.in_range(1, 1024, integer=True))
    #: 1, or tensor_parallel_size x data_parallel_size: experts split whole across those ranks
    expert_parallel_size: int = attrs.field(default=1, validator=v.in_range(1, 1024, integer=True))
    #: pipeline stages (layers split across stages)
    pipeline_parallel_size: int = attrs.field(default=1, validator=v.in_range(1, 1024, integer=True))
    max_model_len: int | None = attrs.field(
        default=None, validator=v.in_range(16, 10_000_000, integer=True, allow_none=True)
    )
    max_num_seqs: int | None = attrs.field(
        default=None, validator=v.in_range(1, 1_000_000, integer=True, allow_none=True)
    )
    #: tokens the engine schedules in one step (prefill chunks included); None: the engine's default
    max_num_batched_tokens: int | None = attrs.field(
        default=None, validator=v.in_range(16, 10_000_000, integer=True, allow_none=True)
    )
    #: split long prompts' prefill into chunks; None: the engine's default
    enable_chunked_prefill: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(v.instance_of(bool, "true or false"))
    )
    #: KV-cache budget in bytes (the memory budget on CPU; on GPU prefer gpu_memory_utilization)
    kv_cache_memory_bytes: int | None = attrs.field(
        default=None, validator=v.in_range(1 << 20, 1 << 50, integer=True, allow_none=True)
    )
    gpu_memory_utilization: float | None = attrs.field(
        default=None, validator=v.in_range(0.0, 1.0, low_open=True, allow_none=True)
    )
    enable_prefix_caching: bool = True
    #: start the engine so that release_memory can really free memory (vLLM sleep mode,
    #: SGLang memory saver); only honoured where Capability.MEMORY_RELEASE is supported
    enable_memory_release: bool = False
    enforce_eager: bool = False
    #: start the engine in its deterministic, batch-invariant mode (vLLM VLLM_BATCH_INVARIANT=1,
    #: SGLang --enable-deterministic-inference); refused where Capability.DETERMINISTIC is not
    #: supported
    deterministic: bool = False
    #: start the engine able to return routed experts (SamplingParams.return_routed_experts) for an
    #: MoE model; refused where Capability.GENERATE_ROUTED_EXPERTS is not supported
    enable_routed_experts: bool = False
    #: start the engine able to return hidden states (SamplingParams.return_hidden_states);
    #: refused where Capability.GENERATE_HIDDEN_STATES is not supported
    enable_hidden_states: bool = attrs.field(default=False, validator=v.instance_of(bool, "true or false"))
    #: start the engine's priority scheduler (vLLM scheduling_policy="priority", SGLang
    #: --enable-priority-scheduling), so that GenerateRequest.priority is honoured (capability
    #: generate.priority); off, the engines queue first come, first served and refuse priorities
    priority_scheduling: bool = attrs.field(default=False, validator=v.instance_of(bool, "true or false"))
    #: read every update back (engine checksums vs the trainer's, where weights.checksum is
    #: claimed); a difference raises WeightVerificationError (see docs/weights.md)
    verify_updates: bool = True
    #: the most bytes stage_weights may hold in the engine at once (capability weights.staged,
    #: see docs/weights.md); None: one full copy of the weights (the sum of weight_specs)
    max_staged_weight_bytes: int | None = attrs.field(
        default=None, validator=v.in_range(1, v.MAX_INT64, integer=True, allow_none=True)
    )
    #: how the engine loads the weights at start. "dummy": random weights of the right shapes (a
    #: fast start when the trainer pushes its weights at once, verl's default): the engine then
    #: refuses generation (WeightsNotLoaded) until a full update_weights has loaded
    load_format: LoadFormat = attrs.field(default="auto", validator=v.one_of("auto", "safetensors", "pt", "dummy"))
    #: the longest prompt a request may have, in tokens (verl's prompt_length); None: only the
    #: engine's context length limits it
    max_prompt_tokens: int | None = attrs.field(
        default=None, validator=v.in_range(1, 10_000_000, integer=True, allow_none=True)
    )
    #: the largest ``max_tokens`` a request may ask for (verl's response_length; also the default
    #: max_tokens of an untouched default_sampling); None: no limit
    max_response_tokens: int | None = attrs.field(
        default=None, validator=v.in_range(1, 10_000_000, integer=True, allow_none=True)
    )
    #: the sampling a trainer gets from :meth:`sampling` (verl's temperature, top_k, top_p, n,
    #: response_length...); requests carry their own SamplingParams, this is where to start from
    default_sampling: SamplingParams = attrs.field(
        factory=SamplingParams, converter=_to_sampling, validator=_check_sampling
    )
    #: the sampling for validation rollouts (verl's val_kwargs); None: default_sampling
    validation_sampling: SamplingParams | None = attrs.field(
        default=None, converter=_to_sampling, validator=_check_sampling
    )
    request_timeout_s: float = attrs.field(default=300.0, validator=v.in_range(0.0, 86400.0, low_open=True))
    startup_timeout_s: float = attrs.field(default=900.0, validator=v.in_range(0.0, 86400.0, low_open=True))
    engine_kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    #: "inprocess": the engine client lives in the caller's process (the engine's own worker
    #: processes are its children). "server": the backend launches the engine's real HTTP server
    #: (``vllm serve``, ``sglang.launch_server``) as a child process on 127.0.0.1 with a free port
    #: and implements every operation over HTTP; backends without a server flavour refuse it
    serving: Serving = attrs.field(default="inprocess", validator=v.one_of("inprocess", "server"))
    #: attach to an engine server someone else started (``http://host:port``); implies
    #: serving="server". Shutdown then leaves that server running, and engine_processes reports none
    server_url: str | None = attrs.field(default=None, validator=v.server_url)
    #: the old name of ``serving`` (kept working): when given it sets ``serving`` and reads None
    #: afterwards. Config files never set it: there ``mode`` is verl's async/sync
    mode: Serving | None = attrs.field(default=None, validator=v.one_of(None, "inprocess", "server"))

    def __attrs_post_init__(self) -> None:
        if not self.model:
            raise InvalidRequest("model", "must be a model directory or name, got ''")
        if self.mode is not None:
            object.__setattr__(self, "serving", self.mode)
            object.__setattr__(self, "mode", None)
        ranks = self.tensor_parallel_size * self.data_parallel_size
        if self.expert_parallel_size not in (1, ranks):
            raise InvalidRequest(
                "expert_parallel_size",
                f"must be 1 or tensor_parallel_size x data_parallel_size = {ranks} (experts are split whole "
                f"across every rank of a pipeline stage), got {self.expert_parallel_size}",
            )
        limit = self.max_response_tokens
        if limit is not None and self.default_sampling == SamplingParams():
            # verl's response_length: the limit is also the default length
            object.__setattr__(self, "default_sampling", SamplingParams(max_tokens=limit))
        for name, sampling in (
            ("default_sampling", self.default_sampling),
            ("validation_sampling", self.validation_sampling),
        ):
            if limit is not None and sampling is not None and sampling.max_tokens > limit:
                raise InvalidRequest(
                    name, f"max_tokens must be <= max_response_tokens ({limit}), got {sampling.max_tokens}"
                )

    @property
    def server_mode(self) -> bool:
        """True when the engine is driven over HTTP (``serving="server"`` or a ``server_url``)."""
        return self.serving == "server" or self.server_url is not None

    @property
    def world_size(self) -> int:
        """The engine's ranks: tensor x data x pipeline parallel sizes (one process or GPU each).

        What a torch.distributed weight-broadcast group needs per engine, beyond the trainer."""
        return self.tensor_parallel_size * self.data_parallel_size * self.pipeline_parallel_size

    def sampling(self, *, validation: bool = False, **overrides: Any) -> SamplingParams:
        """``default_sampling`` (or ``validation_sampling`` with ``validation``) with ``overrides``
        (SamplingParams fields) on top: where a trainer's requests start from."""
        base = (
            self.validation_sampling if validation and self.validation_sampling is not None else self.default_sampling
        )
        return attrs.evolve(base, **overrides) if overrides else base

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> EngineConfig:
        """Read a YAML or TOML config file (rlinfer's ``rollout:`` section or verl's layout as-is);
        ``overrides`` (e.g. command-line values) win. See :mod:`rlinfer_core.config_file`."""
        from rlinfer_core.config_file import from_file

        return from_file(path, **overrides)
