"""vLLM's tokenizer routes: ``/tokenize``, ``/detokenize``, ``/v1/chat/completions/render`` and
``/v1/completions/render``, in vLLM's shapes. They use the model's tokenizer and chat template in
the server (the same rendering as ``/v1/chat/completions``); the engine is not involved.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.tools import to_tools
from rlinfer_core.types import GenerateRequest, SamplingParams
from rlinfer_server import convert
from rlinfer_server.app import ServerState
from rlinfer_server.openai_api import check_model, plan_chat, render
from rlinfer_server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeChatBody,
    TokenizeCompletionBody,
)

router = APIRouter()


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.rlinfer
    return state


def _validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _max_len(state: ServerState) -> int | None:
    value = getattr(state.engine.model_info, "max_model_len", None)
    return value if isinstance(value, int) else None


@router.post("/tokenize")
async def tokenize(request: Request, data: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
    """A text ``prompt`` or chat ``messages`` (rendered by the chat template, ``tools`` too) ->
    ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    state = _state(request)
    body: TokenizeChatBody | TokenizeCompletionBody
    ids: list[int]
    if "messages" in data:
        chat = _validated(TokenizeChatBody, data)
        if chat.model is not None:
            check_model(state, chat.model)
        tools = to_tools([t.model_dump(exclude_none=True) for t in chat.tools]) if chat.tools else None
        ids = list(render(state, chat, tools, limit=False).token_ids)
        body = chat
    else:
        text = _validated(TokenizeCompletionBody, data)
        if text.model is not None:
            check_model(state, text.model)
        ids = state.tokens.encode(text.prompt, text.add_special_tokens)
        body = text
    return {
        "count": len(ids),
        "max_model_len": _max_len(state),
        "tokens": ids,
        "token_strs": state.tokens.strings(ids) if body.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    """Token ids -> ``{"prompt": text}`` (special tokens kept, as vLLM)."""
    state = _state(request)
    if body.model is not None:
        check_model(state, body.model)
    vocab = len(state.tokens.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest("tokens", f"ids must be in [0, {vocab}), got {bad[:5]}")
    return {"prompt": state.tokens.decode(body.tokens, skip_special_tokens=False)}


def sampling_params(s: SamplingParams) -> dict[str, Any]:
    """rlinfer's SamplingParams under vLLM's names (the render routes' ``sampling_params``)."""
    structured = None
    if s.structured is not None:
        key = {"json_schema": "json", "regex": "regex", "choice": "choice"}[s.structured.kind.value]
        structured = {key: list(s.structured.value) if key == "choice" else s.structured.value}
    return {
        "n": s.n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": 0 if s.top_k == -1 else s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "stop": list(s.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "max_tokens": s.max_tokens,
        "min_tokens": s.min_tokens,
        "logprobs": s.logprobs,
        "prompt_logprobs": 0 if s.prompt_logprobs else None,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "logit_bias": {str(t): b for t, b in s.logit_bias} or None,
        "allowed_token_ids": list(s.allowed_token_ids) if s.allowed_token_ids is not None else None,
        "structured_outputs": structured,
        "logprobs_mode": s.logprobs_mode.value,
    }


def _rendered(gen: GenerateRequest, model: str, stream: bool, stream_options: Any, prefix: str) -> dict[str, Any]:
    return {
        "request_id": f"{prefix}-{gen.request_id}",
        "token_ids": list(gen.prompt_token_ids or ()),
        "features": None,
        "sampling_params": sampling_params(gen.sampling),
        "model": model,
        "stream": stream,
        "stream_options": stream_options.model_dump() if stream and stream_options is not None else None,
    }


@router.post("/v1/chat/completions/render")
async def render_chat_completion(body: ChatRequest, request: Request) -> dict[str, Any]:
    """A chat request as the engine would get it (vLLM's token-in ``GenerateRequest`` shape):
    ``token_ids`` of the rendered prompt and the ``sampling_params``; nothing is generated."""
    state = _state(request)
    _prompt, _plan, gen = plan_chat(state, body)
    return _rendered(gen, body.model, body.stream, body.stream_options, "chatcmpl")


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, request: Request) -> list[dict[str, Any]]:
    """A completions request as the engine would get it: one item per prompt."""
    state = _state(request)
    check_model(state, body.model)
    requests = convert.completion_requests(body, state.tokens)
    return [_rendered(g, body.model, body.stream, body.stream_options, "cmpl") for g in requests]
