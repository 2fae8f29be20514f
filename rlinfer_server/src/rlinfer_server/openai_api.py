"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming too),
``/v1/models``, plus ``/health`` and ``/metrics``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlinfer_core.errors import RLInferError
from rlinfer_core.tools import ToolCalls
from rlinfer_core.types import CompletionDelta, GenerateRequest
from rlinfer_server import convert
from rlinfer_server.app import ServerState
from rlinfer_server.chat_render import RenderedChat, render_chat
from rlinfer_server.errors import HTTPError, error_body, status_of
from rlinfer_server.guard import Access
from rlinfer_server.schemas import ChatRequest, ChatTemplateFields, CompletionRequest
from rlinfer_server.tool_choice import ToolPlan, answer, plan_tools

router = APIRouter()
open_router = APIRouter(tags=[Access.OPEN])


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.rlinfer
    return state


def check_model(state: ServerState, model: str) -> None:
    """404 unless ``model`` is the served model's name."""
    if model != state.settings.served_model_name:
        raise HTTPError(
            404,
            f"model {model!r} is not served here; this server serves {state.settings.served_model_name!r}",
            "model",
            "model_not_found",
        )


@open_router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine serves, 503 otherwise."""
    state = _state(request)
    try:
        await state.engine.check_health()
    except RLInferError as exc:
        return JSONResponse(error_body(str(exc), "engine_dead"), status_code=503)
    return JSONResponse({"status": "ok", "weight_version": state.engine.weight_version})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    state = _state(request)
    state.metrics.weight_version.set(state.engine.weight_version)
    state.metrics.in_flight.set(len(state.engine.in_flight))
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The one served model."""
    state = _state(request)
    engine = state.engine
    info = engine.model_info
    card = {
        "id": state.settings.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "rlinfer",
        "root": engine.config.model,
        "max_model_len": getattr(info, "max_model_len", None),
        "weight_version": engine.weight_version,
    }
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI completions over token ids or text prompts."""
    state = _state(request)
    check_model(state, body.model)
    requests = convert.completion_requests(body, state.tokens)
    if body.stream:
        detok = convert.Detokenizer(state.tokens, body.skip_special_tokens)

        async def chunk(delta: CompletionDelta) -> dict[str, Any]:
            offset = detok.offset(delta.index)
            text = detok.push(delta.index, delta.token_ids, delta.finish_reason is not None)
            return convert.completion_chunk(body, delta, text, offset, state.tokens)

        return await _stream(state, "/v1/completions", requests[0], chunk, body.stream_options)
    started = time.perf_counter()
    done = await state.engine.generate(requests)
    _count(state, "/v1/completions", done, started)
    return JSONResponse(convert.completion_response(body, requests, done, state.tokens))


def _max_model_len(state: ServerState) -> int | None:
    info = state.engine.model_info
    value = getattr(info, "max_model_len", None)
    return value if isinstance(value, int) else None


def render(state: ServerState, body: ChatTemplateFields, tools: Any, limit: bool) -> RenderedChat:
    """``body``'s messages rendered by the chat template (the prompt length checked when ``limit``)."""
    return render_chat(
        state.tokens.tokenizer,
        body,
        tools,
        trust_request_template=state.settings.trust_request_chat_template,
        max_model_len=_max_model_len(state) if limit else None,
    )


def plan_chat(state: ServerState, body: ChatRequest) -> tuple[RenderedChat, ToolPlan, GenerateRequest]:
    """A chat body's rendered prompt, tool plan and engine request (every check before the engine)."""
    check_model(state, body.model)
    plan = plan_tools(body, state.settings.tool_call_parser)
    prompt = render(state, body, plan.specs, limit=True)
    return prompt, plan, convert.chat_request(body, prompt, plan)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    """OpenAI chat completions: the server renders the chat template (tools and tool-call history
    included) and reads tool calls from the answers (see :mod:`rlinfer_server.tool_choice`)."""
    state = _state(request)
    prompt, plan, gen = plan_chat(state, body)
    if body.stream:
        return await _stream(
            state, "/v1/chat/completions", gen, _chat_chunks(state, body, prompt, plan), body.stream_options
        )
    started = time.perf_counter()
    done = await state.engine.generate([gen])
    _count(state, "/v1/chat/completions", done, started)
    return JSONResponse(convert.chat_response(body, prompt, plan, done, state.tokens))


def _chat_chunks(
    state: ServerState, body: ChatRequest, prompt: RenderedChat, plan: ToolPlan
) -> Callable[[CompletionDelta], Awaitable[dict[str, Any]]]:
    """The chunk maker of a chat stream. When answers are read as tool calls, content is held
    back and the last chunk of each sample carries the content and the ``tool_calls`` (with
    their ``index``); token ids, logprobs and versions stream as usual."""
    detok = convert.Detokenizer(state.tokens, body.skip_special_tokens)
    seen: set[int] = set()
    first_chunk = [True]

    async def chunk(delta: CompletionDelta) -> dict[str, Any]:
        message: dict[str, Any] = {}
        if delta.index not in seen:
            seen.add(delta.index)
            message["role"] = "assistant"
        final = delta.finish_reason is not None
        text = detok.push(delta.index, delta.token_ids, final)
        finish = delta.finish_reason.value if delta.finish_reason is not None else None
        if not plan.reads_calls:
            message["content"] = text
        elif final:
            ids = detok.token_ids(delta.index)
            found = await _parse_calls(state, plan, ids)
            said = answer(plan, state.tokens.decode(ids, body.skip_special_tokens), finish or "stop", found)
            message["content"] = said.content
            if said.tool_calls:
                message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(said.tool_calls)]
            finish = said.finish_reason
        head = prompt if first_chunk[0] else None
        first_chunk[0] = False
        return convert.chat_chunk(body, delta, message, finish, state.tokens, head)

    return chunk


async def _parse_calls(state: ServerState, plan: ToolPlan, ids: list[int]) -> ToolCalls | None:
    """The engine parser's reading of a streamed output (as the facade reads a batch output:
    special tokens kept, a final EOS dropped)."""
    if plan.parser is None:
        return None
    info = state.engine.model_info
    eos = set(getattr(info, "eos_token_ids", ()) or ())
    if ids and ids[-1] in eos:
        ids = ids[:-1]
    text = state.tokens.decode(ids, skip_special_tokens=False)
    found: ToolCalls = await state.engine.parse_tool_calls(text, plan.parser, plan.specs or ())
    return found


def _count(state: ServerState, endpoint: str, done: list[Any], started: float) -> None:
    usage = convert.usage(done)
    state.metrics.tokens(usage["prompt_tokens"], usage["completion_tokens"])
    state.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _stream(
    state: ServerState,
    endpoint: str,
    gen: GenerateRequest,
    chunk: Callable[[CompletionDelta], Awaitable[dict[str, Any]]],
    options: Any,
) -> Response:
    """Start the stream before answering, so that errors before the first token are HTTP errors."""
    started = time.perf_counter()
    deltas = state.engine.stream(gen)
    try:
        first = await anext(deltas)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await deltas.aclose()
        raise
    include_usage = bool(options and options.include_usage)

    async def body() -> AsyncIterator[bytes]:
        generated = 0
        try:
            delta = first
            while delta is not None:
                generated += len(delta.token_ids)
                yield _sse(await chunk(delta))
                delta = await anext(deltas, None)
            if include_usage:
                prompt = len(gen.prompt_token_ids or ())
                usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
                yield _sse({"id": gen.request_id, "object": "usage", "choices": [], "usage": usage})
        except RLInferError as exc:  # after the 200 header: report in the stream, then end it
            status, kind, param = status_of(exc)
            yield _sse(error_body(str(exc), kind, param, str(status)))
        finally:
            await deltas.aclose()
            state.metrics.tokens(len(gen.prompt_token_ids or ()), generated)
            state.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
