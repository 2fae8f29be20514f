"""ASGI middleware in front of every route: bearer tokens, body size, request metrics.

Runs before FastAPI parses anything, so a caller without the right token learns nothing about
the body's schema, and an oversize body is refused before it is buffered.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rlinfer_server.errors import error_body
from rlinfer_server.metrics import Metrics
from rlinfer_server.settings import ServerSettings, token_matches

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
#: endpoint labels for metrics; anything else counts as "other" (bounded label cardinality)
KNOWN_PATHS = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/tokenize",
        "/detokenize",
        "/control/update_weights",
        "/control/init_weight_broadcast",
        "/control/pause",
        "/control/resume",
        "/control/abort",
        "/control/release_memory",
        "/control/resume_memory",
        "/control/reset_prefix_cache",
        "/control/weight_version",
        "/control/weights_checksum",
        "/control/info",
    }
)


def access(path: str, control_paths: frozenset[str] = frozenset()) -> str:
    """Which key a path needs: "open", "control" or "generate" (``control_paths``: a dialect's
    control routes, on top of ``/control/*``)."""
    if path in OPEN_PATHS:
        return "open"
    if path.startswith("/control/") or path == "/control" or path in control_paths:
        return "control"
    return "generate"


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
        control_paths: frozenset[str] = frozenset(),
        open_paths: frozenset[str] = frozenset(),
        known_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.control_paths = control_paths
        self.open_paths = open_paths
        self.known_paths = KNOWN_PATHS | known_paths | control_paths | open_paths

    def _denied(self, path: str, header: str | None) -> tuple[int, str] | None:
        s = self.settings
        need = "open" if path in self.open_paths else access(path, self.control_paths)
        if need == "open":
            return None
        if need == "control":
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
        label = path if path in self.known_paths else "other"
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
