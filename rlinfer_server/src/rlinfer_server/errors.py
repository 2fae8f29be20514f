"""rlinfer errors -> HTTP status codes and OpenAI-style JSON error bodies.

Every error body is ``{"error": {"message", "type", "param", "code"}}``; ``param`` names the
request field at fault where there is one.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlinfer_core.errors import (
    BackendLoadError,
    BackendNotFound,
    EngineDead,
    EngineOutOfMemory,
    EngineTimeout,
    InvalidRequest,
    RLInferError,
    UnsupportedCapability,
    WeightUpdateError,
)


class HTTPError(Exception):
    """An error the server raises itself (auth, model name, body size)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The JSON error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def status_of(exc: BaseException, control: bool = False) -> tuple[int, str, str | None]:
    """(HTTP status, error type, param) of an rlinfer error.

        UnsupportedCapability is 400 on generation (the request asked for it) and 501 on control (the
        operation itself is unavailable here). WeightUpdateError is 422 when the update itself was
        invalid (the checkpoint, its tensors or the transport); the control routes answer 409 themselves
    for state conflicts (a version not above the current one, released weights). EngineOutOfMemory
    is 503 when transient (retry later, as SGLang answers a request retracted under KV pressure)
    and 400 when the request can never fit the KV cache (as both engines answer an over-long prompt).
    """
    if isinstance(exc, InvalidRequest):
        return 400, "invalid_request_error", exc.field
    if isinstance(exc, UnsupportedCapability):
        return (501 if control else 400), "unsupported_capability", exc.capability
    if isinstance(exc, EngineOutOfMemory):
        return (503 if exc.transient else 400), "engine_out_of_memory", None
    if isinstance(exc, EngineTimeout):
        return 504, "engine_timeout", None
    if isinstance(exc, EngineDead):
        return 503, "engine_dead", None
    if isinstance(exc, WeightUpdateError):
        return 422, "weight_update_error", None
    if isinstance(exc, BackendNotFound | BackendLoadError):
        return 500, "backend_error", None
    if isinstance(exc, RLInferError):
        return 500, "rlinfer_error", None
    return 500, "internal_error", None


def response_for(exc: BaseException, control: bool = False) -> JSONResponse:
    """The JSON error response of ``exc``."""
    status, kind, param = status_of(exc, control)
    message = str(exc) if isinstance(exc, RLInferError) else f"internal error: {type(exc).__name__}"
    return JSONResponse(error_body(message, kind, param), status_code=status)


def _loc_param(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "header", "path")]
    # pydantic puts the union member's type name in the path ("str", "list[int]"): drop it
    parts = [p for p in parts if not (p.startswith(("list[", "dict[")) or p in ("str", "int", "float", "bool"))]
    return ".".join(parts) or "body"


async def validation_handler(_request: Request, exc: Exception) -> JSONResponse:
    """400 naming the first bad field (unknown fields, wrong types, bad JSON)."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": "invalid"}
    param = _loc_param(tuple(first.get("loc", ())))
    kind = str(first.get("type", ""))
    if kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif kind == "json_invalid":
        param = "body"
        message = f"the body is not valid JSON: {first.get('msg', '')}"
    elif kind == "missing":
        message = f"field {param!r} is required"
    else:
        message = f"invalid {param}: {first.get('msg', '')}"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return JSONResponse(error_body(message + more, "invalid_request_error", param, kind or None), status_code=400)


async def http_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    """The server's own errors (auth, model name, size)."""
    assert isinstance(exc, HTTPError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.message, exc.kind, exc.param), status_code=exc.status, headers=headers)


async def starlette_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    """404/405 and friends in the same JSON shape."""
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(
        error_body(str(exc.detail), "invalid_request_error", None), status_code=exc.status_code, headers=exc.headers
    )


async def rlinfer_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """rlinfer errors raised by an endpoint (status from :func:`status_of`)."""
    return response_for(exc, control=request.url.path.startswith("/control/"))
