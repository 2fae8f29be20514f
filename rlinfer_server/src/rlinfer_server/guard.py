"""ASGI middleware in front of every route: bearer tokens, body size, request metrics.

Runs before FastAPI parses anything, so a caller without the right token learns nothing about
the body's schema, and an oversize body is refused before it is buffered.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from rlinfer_server.errors import error_body
from rlinfer_server.metrics import Metrics
from rlinfer_server.settings import ServerSettings, token_matches

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Access(enum.StrEnum):
    """The key a route needs; a route states it as its router's tag (none: the generate key)."""

    OPEN = "open"
    CONTROL = "control"
    GENERATE = "generate"


def route_access(routes: Iterable[BaseRoute]) -> dict[str, Access]:
    """Every route's path and the key it needs, from its tags."""
    table = {}
    for route in routes:
        if isinstance(route, APIRoute):
            tags = set(route.tags)
            table[route.path] = next((a for a in (Access.CONTROL, Access.OPEN) if a in tags), Access.GENERATE)
    return table


def access(path: str, routes: Mapping[str, Access]) -> Access:
    """Which key ``path`` needs: its route's (``routes``: :func:`route_access`); any path under
    ``/control`` needs the control key, a route there or not."""
    if path.startswith("/control/") or path == "/control":
        return Access.CONTROL
    return routes.get(path, Access.GENERATE)


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    base = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": base + headers})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """Token check, body-size limit and request counting (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        settings: ServerSettings,
        metrics: Metrics,
        routes: Mapping[str, Access],
    ) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics
        #: every route's path and the key it needs (:func:`route_access`)
        self.routes = routes

    def _denied(self, path: str, header: str | None) -> tuple[int, str] | None:
        s = self.settings
        need = access(path, self.routes)
        if need is Access.OPEN:
            return None
        if need is Access.CONTROL:
            if s.open_control and s.api_key is None:
                return None  # --open-control: keyless control, served on loopback only (settings.check)
            if s.api_key is None:
                return 403, "control endpoints are disabled: start the server with --api-key (or $RLINFER_API_KEY)"
            ok = token_matches(header, s.api_key)
        else:
            ok = s.generate_api_key is None or token_matches(header, s.generate_api_key)
            ok = ok or token_matches(header, s.api_key)
        if ok:
            return None
        what = "missing" if header is None else "wrong"
        return 401, f"{what} bearer token (send the header 'Authorization: Bearer KEY')"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        label = path if path in self.routes else "other"
        status_box = [0]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = int(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, counting_send, path)
        finally:
            self.metrics.requests.labels(label, str(status_box[0] or 499)).inc()

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        denied = self._denied(path, headers.get("authorization"))
        if denied is not None:
            status, reason = denied
            kind = "authentication_error" if status == 401 else "permission_error"
            extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
            await _send_json(send, status, error_body(reason, kind, "authorization"), extra)
            return
        limit = self.settings.max_body_bytes
        too_big = error_body(f"the body is larger than the limit of {limit} bytes", "invalid_request_error", "body")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _send_json(send, 413, too_big, [])
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                await _send_json(send, 413, too_big, [])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: disconnect notices for streaming responses

        await self.app(scope, replay, send)
