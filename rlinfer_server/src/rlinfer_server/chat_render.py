"""Chat messages -> prompt text and token ids, by the model's Hugging Face chat template.

The server renders the template itself (as vLLM's server does) and sends the engine token ids, so
everything vLLM's chat endpoint takes reaches the template: assistant ``tool_calls`` and ``tool``
results in the history, ``tools``, ``documents``, ``chat_template`` (only with
``--trust-request-chat-template``), ``chat_template_kwargs``, ``add_generation_prompt`` and
``continue_final_message``. The result is what the engine's own ``messages`` path renders
(:func:`rlinfer_core.chat_template.prompt_ids`): the template's text tokenised without added
special tokens unless ``add_special_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.multimodal import Image, to_image
from rlinfer_core.tools import ToolSpec
from rlinfer_server.schemas import ChatMessageIn, ChatTemplateFields, ImageUrlPart, TextPart, ToolCallIn

#: apply_chat_template arguments a request's chat_template_kwargs may not set (the server sets them)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
        "chat_template",
    }
)


@attrs.frozen
class RenderedChat:
    """A rendered conversation: the template's text and its token ids."""

    text: str
    token_ids: tuple[int, ...]
    #: the messages' images in prompt order (image_url parts), sent beside the token ids
    images: tuple[Image, ...] = ()


def _arguments(call: ToolCallIn) -> dict[str, Any]:
    """A history tool call's arguments as the object templates expect (OpenAI sends JSON text);
    text that is not a JSON object becomes ``{}`` so that the conversation can go on, as vLLM does."""
    value = call.function.arguments
    if isinstance(value, dict):
        return value
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def template_message(message: ChatMessageIn, index: int = 0) -> dict[str, Any]:
    """One message as the chat template sees it (text parts joined by newlines, as vLLM does)."""
    if message.function_call is not None:
        raise InvalidRequest(
            f"messages.{index}.function_call", "the deprecated functions API is not supported; use tool_calls"
        )
    if message.audio is not None:
        raise InvalidRequest(f"messages.{index}.audio", "rlinfer serves text models")
    content = message.content
    out: dict[str, Any] = {"role": message.role, "content": _template_content(content)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequest(
                f"messages.{index}.tool_calls", f"only assistant messages have tool_calls, not {message.role!r}"
            )
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def _template_content(content: str | list[TextPart | ImageUrlPart] | None) -> Any:
    """Text parts joined by newlines (as vLLM does); with image parts, the parts in order with
    each image as ``{"type": "image"}`` (the template renders the model's placeholder)."""
    if not isinstance(content, list):
        return content or ""
    if not any(isinstance(p, ImageUrlPart) for p in content):
        return "\n".join(p.text for p in content if isinstance(p, TextPart))
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in content]


def message_images(messages: Sequence[ChatMessageIn]) -> tuple[Image, ...]:
    """The images of ``messages``' image_url parts, in order (InvalidRequest for a bad one)."""
    out = []
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, ImageUrlPart):
                out.append(to_image(part.image_url.url, f"messages.{i}.content.{j}.image_url.url"))
    return tuple(out)


def _template_kwargs(body: ChatTemplateFields, trust_request_template: bool) -> dict[str, Any]:
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message", "cannot be true together with add_generation_prompt (set that to false)"
        )
    if body.chat_template is not None and not trust_request_template:
        raise InvalidRequest(
            "chat_template",
            "a chat template in the request needs the server started with --trust-request-chat-template",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequest("chat_template_kwargs", f"may not set {reserved}: they are set by the server")
    kwargs["add_generation_prompt"] = body.add_generation_prompt
    kwargs["continue_final_message"] = body.continue_final_message
    return kwargs


def render_chat(
    tokenizer: Any,
    body: ChatTemplateFields,
    tools: Sequence[ToolSpec] | None,
    *,
    trust_request_template: bool,
    max_model_len: int | None,
) -> RenderedChat:
    """Render ``body.messages`` (with ``tools``) and tokenise the text. InvalidRequest naming the
    field at fault: a refused template or kwargs, a template that fails, an empty or too long prompt."""
    if not body.messages:
        raise InvalidRequest("messages", "must hold at least one message")
    kwargs = _template_kwargs(body, trust_request_template)
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    if body.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("messages", "the model's tokenizer has no chat template; send chat_template")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=[t.to_openai() for t in tools] if tools else None,
            documents=body.documents,
            chat_template=body.chat_template,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:
        field = "chat_template" if body.chat_template is not None else "messages"
        raise InvalidRequest(field, f"the chat template failed: {type(exc).__name__}: {exc}") from None
    ids = tuple(tokenizer.encode(str(text), add_special_tokens=body.add_special_tokens))
    if not ids:
        raise InvalidRequest("messages", "the chat template produced an empty prompt")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise InvalidRequest(
            "messages", f"the templated prompt has {len(ids)} tokens, max_model_len is {max_model_len}"
        )
    return RenderedChat(str(text), ids, message_images(body.messages))
