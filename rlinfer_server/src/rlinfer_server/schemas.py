"""Request bodies. Unknown fields are refused (``extra="forbid"``) and types are strict; value
ranges are checked by rlinfer's own types (SamplingParams, BroadcastGroup...) so that the error
names the same field and allowed range as the Python API does."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    """Base of every body: unknown fields and loose types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    """OpenAI ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Body):
    """Sampling fields shared by both OpenAI endpoints, plus rlinfer's extensions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # rlinfer / vLLM extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs_mode: Literal["processed", "raw"] = "processed"
    #: the engine request id (abort it with POST /control/abort); several prompts get "-i" suffixes
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    #: accepted for vLLM compatibility; token ids are always returned
    return_token_ids: bool | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Body):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ChatMessageIn(Body):
    """One chat message."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class SpecIn(Body):
    """A tensor's name, dtype and shape (for broadcast updates)."""

    name: str
    dtype: str
    shape: list[int]


class UpdateWeightsBody(Body):
    """``POST /control/update_weights``: from a checkpoint directory the server can read, or
    broadcast from rank 0 of a group joined with ``/control/init_weight_broadcast``."""

    source: Literal["disk", "broadcast"]
    path: str | None = None
    specs: list[SpecIn] | None = None
    version: int | None = None


class BroadcastGroupBody(Body):
    """``POST /control/init_weight_broadcast`` (fields of rlinfer_core.weights.BroadcastGroup)."""

    master_addr: str
    master_port: int
    world_size: int = 2
    backend: str = "gloo"
    group_name: str = "rlinfer-weights"
    timeout_s: float = 120.0
    rank_offset: int = 1


class PauseBody(Body):
    """``POST /control/pause``."""

    mode: str = "abort"


class AbortBody(Body):
    """``POST /control/abort`` (no ids: every request in flight)."""

    request_ids: list[str] | None = None


class MemoryBody(Body):
    """``POST /control/release_memory`` and ``/control/resume_memory`` (no tags: all)."""

    tags: list[str] | None = None


class EmptyBody(Body):
    """Endpoints without parameters accept no body or ``{}``."""
