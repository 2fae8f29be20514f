"""Request bodies. Unknown fields are refused (``extra="forbid"``) and types are strict; value
ranges are checked by rlinfer's own types (SamplingParams, BroadcastGroup...) so that the error
names the same field and allowed range as the Python API does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    """Base of every body: unknown fields and loose types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    """OpenAI ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class VllmCompatFields(Body):
    """Fields vLLM's OpenAI server accepts that rlinfer serve does not implement: accepted (so they
    are never "unknown"), and refused with a 400 naming the field when set to anything but their
    neutral value (:mod:`rlinfer_server.compat` holds the values and the reasons)."""

    use_beam_search: Any = None
    length_penalty: Any = None
    watermarking: Any = None
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    logprob_token_ids: Any = None
    bad_words: Any = None
    #: vLLM's request priority, lower first (capability generate.priority)
    priority: int = 0
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    spaces_between_special_tokens: Any = None
    #: accepted and ignored, as hints: rlinfer routes and streams by its own rules
    session_id: Any = None
    stream_interval: Any = None
    #: accepted; the text is always the decode of token_ids, so a matched stop string is in it
    include_stop_str_in_output: Any = None


class JsonSchemaFormat(Body):
    """``response_format.json_schema``: a named JSON schema."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    #: vLLM's structural-tag formats (refused: no engine-neutral form)
    format: Any = None
    structures: Any = None
    triggers: Any = None


class StructuredOutputsIn(Body):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``
    (EBNF), ``json_object`` (honoured), or ``structural_tag`` (refused: no engine-neutral form)."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingFields(VllmCompatFields):
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
    #: -1 or 0 (vLLM's two spellings): no top-k cut
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
    #: logprob entries name tokens as "token_id:N" instead of their text (vLLM's option)
    return_tokens_as_token_ids: bool | None = None
    #: the prompt tokens' own logprobs (0; vLLM's top-k alternatives of prompt tokens are not offered)
    prompt_logprobs: int | None = None
    #: output text without special tokens (default) or with them
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    #: each choice carries ``routed_experts`` (SGLang's name; capability generate.routed_experts)
    return_routed_experts: bool = False


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    #: text prompts get the model's special tokens (e.g. BOS) unless false
    add_special_tokens: bool = True
    prompt_embeds: Any = None


class TextPart(Body):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ImageUrl(Body):
    """An image part's image: a ``data:image/...;base64,`` URL (the server fetches nothing)."""

    url: str
    detail: str | None = None


class ImageUrlPart(Body):
    """An image part of a chat message's content (OpenAI's ``image_url``; capability
    generate.multimodal of the served engine)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCallIn(Body):
    """The function of an assistant message's tool call: ``arguments`` as JSON text (OpenAI) or
    an object."""

    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(Body):
    """One tool call of an assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(Body):
    """One chat message: ``tool_calls`` on assistant turns, ``tool_call_id`` on tool results."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImageUrlPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    #: an earlier turn's reasoning, for templates that render it (vLLM's name; reasoning_content too)
    reasoning: str | None = None
    reasoning_content: str | None = None
    #: OpenAI assistant fields: ``refusal`` is accepted (templates do not render it); the
    #: deprecated ``function_call`` and ``audio`` are refused with the field named
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None


class FunctionDefinitionIn(Body):
    """A tool's function: name, description and a JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ToolIn(Body):
    """One tool of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinitionIn
    defer_loading: bool | None = None


class NamedFunction(Body):
    """``tool_choice.function``."""

    name: str


class NamedToolChoice(Body):
    """``tool_choice`` naming one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateFields(Body):
    """How messages are rendered by the chat template (chat, ``/tokenize``, render)."""

    messages: list[ChatMessageIn]
    tools: list[ToolIn] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: add the tokenizer's special tokens (e.g. BOS) on top of what the template renders
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    #: a Jinja template for this request (needs --trust-request-chat-template, as in vLLM)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None


class ChatRequest(SamplingFields, ChatTemplateFields):
    """``POST /v1/chat/completions`` (and ``/v1/chat/completions/render``)."""

    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: the rendered prompt text in the response (vLLM's option)
    return_prompt_text: bool | None = None
    #: accepted; without a reasoning parser there is no reasoning to include or leave out
    include_reasoning: bool = True
    reasoning_effort: str | None = None
    echo: bool = False


class TokenizeCompletionBody(Body):
    """``POST /tokenize`` with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatBody(ChatTemplateFields):
    """``POST /tokenize`` with chat messages (rendered by the chat template)."""

    model: str | None = None
    return_token_strs: bool | None = False


class DetokenizeBody(Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


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
