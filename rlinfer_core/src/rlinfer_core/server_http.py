"""HTTP calls to an engine server with rlinfer's typed errors (engine-agnostic; httpx).

- a 4xx answer -> :class:`InvalidRequest` naming the field the server names (``param``, or the
  last location of a pydantic validation error), else "request";
- no connection, a connection dropped mid-answer, or a 5xx from a server that is gone ->
  :class:`EngineDead`;
- a timeout -> :class:`EngineTimeout` (every call has one: the client's, or the call's own);
- any other 5xx -> :class:`ServerError` (the caller maps it, e.g. to WeightUpdateError).

Whether the server is gone is decided by its processes when it was launched here (a slow
``/health`` on a loaded machine must not turn a failed operation into EngineDead), by ``/health``
when it was attached to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from rlinfer_core.errors import EngineDead, EngineTimeout, InvalidRequest, RLInferError

#: connecting to a loopback server takes microseconds; a server that does not accept within this
#: is gone or wedged
CONNECT_TIMEOUT_S = 5.0
#: how long a liveness probe (/health) may take before the server counts as dead
HEALTH_TIMEOUT_S = 5.0
#: how often a pending call looks at a launched server's processes (a call whose answer can
#: never come, e.g. the engine process that would produce it was killed, ends with EngineDead)
WATCH_S = 0.25
#: how long an idle connection stays in the pool: below the servers' own keep-alive timeout
#: (uvicorn's timeout_keep_alive, 5 s, in both vLLM's and SGLang's servers). A client that keeps
#: a connection as long as the server races the server's close, and a request sent just as it
#: closes fails with an empty ReadError (seen on an H100: 128 concurrent requests after a 5 s pause)
KEEPALIVE_EXPIRY_S = 2.0

T = TypeVar("T")


class ServerError(RLInferError):
    """The server answered 5xx but is not gone: the operation failed, the engine lives."""

    def __init__(self, engine: str, path: str, status: int, message: str) -> None:
        self.status = status
        self.detail = message
        super().__init__(f"the {engine} server failed {path} (HTTP {status}): {message}")


def _pydantic_field(message: str) -> str | None:
    """The field of the first pydantic error quoted in ``message`` (``'loc': ('body', 'x')``),
    for servers that pass the validation error on as text."""
    import re

    found = re.search(r"'loc': \(([^)]*)\)", message)
    if found is None:
        return None
    parts = [p.strip().strip("'\"") for p in found.group(1).split(",")]
    names = [p for p in parts if p and p not in ("body", "query") and not p.isdigit()]
    return names[-1] if names else None


def error_message(body: Any) -> tuple[str | None, str]:
    """(param, message) from ``{"error": {...}}`` (OpenAI style), ``{"error": "..."}``,
    FastAPI's ``{"detail": ...}``, ``{"message": ..., "param": ...}`` or plain text; a missing
    param is read from a pydantic error quoted in the message."""
    param, message = _error_message(body)
    return param or _pydantic_field(message), message


def _error_message(body: Any) -> tuple[str | None, str]:
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping):
            return error.get("param"), str(error.get("message", error))
        if isinstance(error, str):
            return None, error
        detail = body.get("detail")
        if isinstance(detail, list) and detail and isinstance(detail[0], Mapping):  # pydantic errors
            loc = [str(x) for x in detail[0].get("loc", ()) if x not in ("body", "query")]
            return (loc[-1] if loc else None), str(detail[0].get("msg", detail))
        if detail is not None:
            return None, str(detail)
        if "message" in body:
            param = body.get("param")
            return (param if isinstance(param, str) else None), str(body["message"])
    return None, str(body)


class ServerClient:
    """An ``httpx.AsyncClient`` bound to one server.

    ``engine`` names it in errors; ``dead_pids`` (launched servers; None for attached ones) returns
    the pids of its processes that exited; ``health_path`` is the liveness probe (it must answer
    fast, also while generation is paused).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float,
        engine: str,
        dead_pids: Callable[[], list[int]] | None = None,
        health_path: str = "/health",
    ) -> None:
        import httpx

        self.url = url
        self.health_path = health_path
        self.timeout_s = timeout_s
        self.engine = engine
        self._dead_pids = dead_pids
        self.client = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(
                max_connections=1024, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_EXPIRY_S
            ),
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()

    def check_processes(self) -> None:
        """EngineDead if one of a launched server's processes exited."""
        if self._dead_pids is not None:
            gone = self._dead_pids()
            if gone:
                raise EngineDead(f"{self.engine} server process(es) {gone} died; open a new engine")

    async def healthy(self) -> bool:
        """Whether the server answers the liveness probe with 200 (and its processes run)."""
        import httpx

        if self._dead_pids is not None and self._dead_pids():
            return False
        try:
            response = await self.client.get(self.health_path, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def watched(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable``; EngineDead as soon as one of a launched server's processes exits."""
        if self._dead_pids is None:
            return await awaitable
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_S)
                if done:
                    return task.result()
                self.check_processes()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _dead(self, path: str, exc: BaseException | str) -> EngineDead:
        self.check_processes()
        return EngineDead(
            f"the {self.engine} server at {self.url} stopped answering ({path}: {exc}); open a new engine"
        )

    async def translate(self, path: str, exc: BaseException) -> BaseException:
        """rlinfer's error for an httpx exception raised by a call to ``path``."""
        import httpx

        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            if await self.healthy():
                return EngineTimeout(f"the {self.engine} server did not answer {path} within its timeout ({exc!r})")
            return await self._dead(path, exc)
        if isinstance(exc, httpx.TransportError):  # refused, reset, closed mid-answer
            return await self._dead(path, exc)
        return exc

    async def _gone(self) -> bool:
        if self._dead_pids is not None:
            return bool(self._dead_pids())
        return not await self.healthy()

    @staticmethod
    def _body(response: Any) -> Any:
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    async def check(self, path: str, response: Any) -> Any:
        """The body of a 2xx answer (JSON, text, or None when empty); else the typed error:
        an :class:`InvalidRequest` is *returned* for a 4xx (the caller raises or inspects it),
        EngineDead / ServerError are raised for a 5xx."""
        status = response.status_code
        body = self._body(response)
        if status < 300:
            return body
        return await self.error(path, status, body)

    async def error(self, path: str, status: int, body: Any) -> InvalidRequest:
        """The typed error of an error answer (``status`` >= 300, its ``body``): an
        InvalidRequest is returned for a 4xx; EngineDead or ServerError are raised for a 5xx."""
        param, message = error_message(body)
        if status < 500:
            return InvalidRequest(
                param or "request", f"the {self.engine} server refused {path} (HTTP {status}): {message}"
            )
        if await self._gone():
            raise await self._dead(path, f"HTTP {status}: {message}")
        raise ServerError(self.engine, path, status, message)

    @contextlib.asynccontextmanager
    async def typed_errors(self, path: str) -> AsyncIterator[None]:
        """Errors of a call to ``path`` raised in the block become rlinfer's (:meth:`translate`);
        rlinfer's own errors and a closed generator's GeneratorExit pass through."""
        try:
            yield
        except (RLInferError, GeneratorExit):
            raise
        except Exception as exc:
            translated = await self.translate(path, exc)
            if translated is exc:
                raise
            raise translated from exc

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Any = None,
        timeout_s: float | None = None,
    ) -> tuple[int, Any]:
        """Send a request; (status, body) for any answer below 500 (no InvalidRequest raised:
        for endpoints whose 4xx means "the operation failed", e.g. ``{"success": false}``)."""
        self.check_processes()
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            response = await self.watched(self.client.request(method, path, json=body, params=params, timeout=timeout))
        except Exception as exc:
            raise await self.translate(path, exc) from exc
        if response.status_code >= 500:
            await self.check(path, response)
        return response.status_code, self._body(response)

    async def post(self, path: str, body: Any = None, params: Any = None, timeout_s: float | None = None) -> Any:
        """POST ``body`` as JSON; the answer's body. 4xx raises InvalidRequest."""
        self.check_processes()
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            response = await self.watched(self.client.post(path, json=body, params=params, timeout=timeout))
        except Exception as exc:
            raise await self.translate(path, exc) from exc
        result = await self.check(path, response)
        if isinstance(result, InvalidRequest):
            raise result
        return result

    async def get(self, path: str, timeout_s: float | None = None) -> Any:
        """GET ``path``; the answer's body. 4xx raises InvalidRequest."""
        self.check_processes()
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            response = await self.watched(self.client.get(path, timeout=timeout))
        except Exception as exc:
            raise await self.translate(path, exc) from exc
        result = await self.check(path, response)
        if isinstance(result, InvalidRequest):
            raise result
        return result

    async def stream(self, path: str, body: Any) -> AsyncIterator[Any]:
        """POST ``body`` and yield each server-sent event's JSON (``data: ...``) until ``[DONE]``.

        Closing the iterator closes the connection (engines abort the request then).
        """
        self.check_processes()
        async with self.typed_errors(path), self.client.stream("POST", path, json=body) as response:
            if response.status_code >= 300:
                await response.aread()
                error = await self.check(path, response)
                if isinstance(error, InvalidRequest):
                    raise error
            lines = response.aiter_lines()
            while True:
                try:
                    line = await self.watched(anext(lines))
                except StopAsyncIteration:
                    break
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return
                yield json.loads(data)


__all__ = ["CONNECT_TIMEOUT_S", "HEALTH_TIMEOUT_S", "ServerClient", "ServerError", "error_message"]
