"""A batch generate endpoint inside the real ``vllm serve`` process (an ASGI middleware).

``vllm serve --middleware rlinfer_vllm.api_server.batch_route.BatchRoute`` (rlinfer's launcher
passes it) answers ``POST /rlinfer/v1/generate_batch`` with body ``{"requests": [...]}``, each item
the JSON body of vLLM's token endpoint ``/inference/v1/generate`` (``stream: false``). Every item
goes through the server's own handler of that endpoint (``app.state.serving_tokens.serve_tokens``:
the same validation, request id ``generate-tokens-<request_id>``, sampling defaults and answer as
one call each), but all of them are handed to the engine client in one pass, as the in-process
backend does. Over one HTTP call per request the API server parsed them one by one while the busy
engine took the CPU, and the engine ran many small steps instead of one large batch.

The answer is NDJSON, one line per item as it finishes (early finishers return early):
``{"index": i, "status": 200, "body": <the token endpoint's answer>}``, or an error status with
vLLM's own error body. A client that disconnects cancels the items still running, which aborts
them in the engine (as a dropped connection does on the token endpoint); ``/abort_requests`` with
``generate-tokens-<request_id>`` aborts single items. When the server has API keys
(``--api-key`` / ``VLLM_API_KEY``) the route asks for one, as vLLM's guarded routes do.

On a vLLM whose token endpoint lacks what rlinfer reads (0.26: see
:mod:`rlinfer_vllm.api_server.engine_route`) the items go to the engine client directly and the
answers are written in 0.32's shape; the route then also serves ``POST /rlinfer/v1/weight_version``.
``GET /rlinfer/v1/features`` tells the client which of these the server runs.

This module runs in the server process; it imports vLLM only inside functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rlinfer_vllm.api_server import engine_route

PATH = "/rlinfer/v1/generate_batch"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _line(index: int, status: int, body: Any) -> bytes:
    return json.dumps({"index": index, "status": status, "body": body}).encode() + b"\n"


async def _json_response(send: Send, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _first(*candidates: str) -> Any:
    """The first of ``"module:name"`` candidates that imports (vLLM moved these between 0.26 and
    0.32; the newest comes first)."""
    import importlib

    for candidate in candidates:
        module, _, name = candidate.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {candidates} in this vLLM")


def _create_error_response() -> Any:
    return _first(
        "vllm.entrypoints.serve.exception_handling.error_response:create_error_response",
        "vllm.entrypoints.serve.utils.error_response:create_error_response",
    )


def _error(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    from http import HTTPStatus

    create_error_response = _create_error_response()
    error = create_error_response(message, HTTPStatus(status).phrase, HTTPStatus(status), param)
    return dict(error.model_dump())


def _authorized(app: Any, scope: Scope) -> bool:
    """Whether the request carries one of the server's API keys (True when it has none)."""
    from starlette.datastructures import Headers
    from vllm import envs

    authentication = _first(
        "vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware",
        "vllm.entrypoints.serve.utils.server_utils:AuthenticationMiddleware",
    )
    args = getattr(app.state, "args", None)
    tokens = [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]
    if not tokens:
        return True
    return bool(authentication(app, tokens).verify_token(Headers(scope=scope)))


async def _body(receive: Receive) -> tuple[bytes, bool]:
    """The request body, and whether the client disconnected while sending it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


async def _post_body(scope: Scope, receive: Receive, send: Send, path: str) -> bytes | None:
    """The body of an authorized POST to ``path``; None once a 405/401 was sent or the client left."""
    if scope.get("method") != "POST":
        await _json_response(send, 405, _error(f"{path} takes POST", 405))
        return None
    if not _authorized(scope["app"], scope):
        await _json_response(send, 401, {"error": "Unauthorized"})
        return None
    raw, gone = await _body(receive)
    return None if gone else raw


async def _one(app: Any, scope: Scope, item: Any) -> tuple[int, Any]:
    """(status, body) of one item, as ``/inference/v1/generate`` answers it (on an older vLLM: as
    0.32's answers it, through :mod:`rlinfer_vllm.api_server.engine_route`), its logprobs in the
    compact shape of :func:`rlinfer_vllm.api_server.engine_route.compact`."""
    import pydantic
    from fastapi.exceptions import RequestValidationError
    from starlette.requests import Request
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    validation_exception_handler = _first(
        "vllm.entrypoints.serve.exception_handling.handlers.validation:validation_exception_handler",
        "vllm.entrypoints.serve.utils.server_utils:validation_exception_handler",
    )
    via_engine = engine_route.active()
    handler = app.state.serving_tokens
    if handler is None and not via_engine:
        return 501, _error("the model does not support the generate tokens API", 501)
    try:
        request = GenerateRequest.model_validate(item)
    except pydantic.ValidationError as exc:
        # vLLM's own handler of invalid bodies: the same status, message and param
        response = await validation_exception_handler(
            Request(scope), RequestValidationError(exc.errors(include_url=False))
        )
        return response.status_code, json.loads(bytes(response.body))
    if request.stream:
        return 400, _error("items of a batch cannot stream", 400, "stream")
    try:
        if via_engine:
            return 200, await engine_route.generate(app, request)
        answer = await handler.serve_tokens(request, None)
    except Exception as exc:
        # the app's own exception handler, as for the single-request route (a dead engine core
        # also makes vLLM stop the server there)
        for cls in type(exc).__mro__:
            registered = getattr(app, "exception_handlers", {}).get(cls)
            if registered is not None:
                response = await registered(Request(scope), exc)
                return response.status_code, json.loads(bytes(response.body))
        error = _create_error_response()(exc)
        return int(error.error.code), error.model_dump()
    error_type = _first(
        "vllm.entrypoints.serve.engine.protocol:ErrorResponse",
        "vllm.entrypoints.openai.engine.protocol:ErrorResponse",
    )
    if isinstance(answer, error_type):
        return int(answer.error.code), answer.model_dump()
    return 200, engine_route.compact(answer.model_dump(), with_top=bool(request.sampling_params.logprobs))


class BatchRoute:
    """ASGI middleware serving :data:`PATH`; every other request goes to the app unchanged."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve :data:`PATH`, pass everything else on."""
        if scope["type"] == "http" and scope["path"] == engine_route.FEATURES_PATH:
            authorized = _authorized(scope["app"], scope)
            await _json_response(
                send, *((200, engine_route.features(scope["app"])) if authorized else (401, {"error": "Unauthorized"}))
            )
            return
        if scope["type"] == "http" and scope["path"] == engine_route.VERSION_PATH and engine_route.active():
            await self._version(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        app = scope["app"]
        raw = await _post_body(scope, receive, send, PATH)
        if raw is None:
            return
        try:
            items = json.loads(raw)["requests"]
            if not isinstance(items, list):
                raise TypeError("requests is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            await _json_response(send, 400, _error(f"expected {{'requests': [...]}}: {exc}", 400, "requests"))
            return
        await self._serve(app, scope, receive, send, items)

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /rlinfer/v1/weight_version`` ``{"new_version": N}``: the label of later tokens."""
        app = scope["app"]
        raw = await _post_body(scope, receive, send, engine_route.VERSION_PATH)
        if raw is None:
            return
        try:
            answer = engine_route.set_version(app, json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            await _json_response(send, 400, _error(f"expected {{'new_version': N}}: {exc}", 400, "new_version"))
            return
        await _json_response(send, 200, answer)

    async def _serve(self, app: Any, scope: Scope, receive: Receive, send: Send, items: list[Any]) -> None:
        async def one(index: int, item: Any) -> bytes:
            status, body = await _one(app, scope, item)
            return _line(index, status, body)

        # created in one pass: every item reaches the engine client before the engine gets a
        # chance to take the CPU
        tasks = {asyncio.ensure_future(one(i, item)) for i, item in enumerate(items)}
        disconnected = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]}
            )
            pending = set(tasks)
            while pending:
                done, _ = await asyncio.wait(pending | {disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if disconnected in done:
                    return
                for task in done:
                    pending.discard(task)
                    await send({"type": "http.response.body", "body": task.result(), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            # cancelling an item's task cancels its engine generator, which aborts it in the engine
            disconnected.cancel()
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*tasks, disconnected, return_exceptions=True)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


__all__ = ["PATH", "BatchRoute"]
