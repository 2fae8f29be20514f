"""HTTP calls to a vLLM server, with rlinfer's typed errors.

- a 4xx answer -> :class:`InvalidRequest` naming the field vLLM names (``param``), else "request";
- no connection, a connection dropped mid-answer, or a 5xx from a server that no longer answers
  ``/health`` -> :class:`EngineDead`;
- a timeout -> :class:`EngineTimeout` (every call has one: ``EngineConfig.request_timeout_s``, or
  the call's own);
- any other 5xx -> :class:`ServerError` (the caller maps it: a weight update raises
  WeightUpdateError).
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

from rlinfer_core.errors import EngineDead, EngineTimeout, InvalidRequest, RLInferError

#: connecting to a loopback server takes microseconds; a server that does not accept within this
#: is gone or wedged
CONNECT_TIMEOUT_S = 5.0
#: how long a liveness probe (/health) may take before the server counts as dead
HEALTH_TIMEOUT_S = 5.0


class ServerError(RLInferError):
    """The server answered 5xx but still answers /health: the operation failed, the engine lives."""

    def __init__(self, path: str, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"the vLLM server failed {path} (HTTP {status}): {message}")


class RouteMissing(RLInferError):
    """The server answered 404 for a route (an attached server without rlinfer's middleware)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"the vLLM server has no {path}")


def b64(data: bytes) -> dict[str, str]:
    """A bytes argument for :meth:`ServerClient.rpc` (decoded by the worker's ``rlinfer_http``)."""
    return {"b64": base64.b64encode(data).decode("ascii")}


def _error_message(body: Any) -> tuple[str | None, str]:
    """(param, message) from vLLM's ``{"error": {...}}``, FastAPI's ``{"detail": ...}`` or text."""
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
    return None, str(body)


class ServerClient:
    """An ``httpx.AsyncClient`` bound to one server; ``alive`` says whether the server's
    processes still run (launched servers; attached ones: None)."""

    def __init__(self, url: str, timeout_s: float, alive: Callable[[], list[int]] | None = None) -> None:
        import httpx

        self.url = url
        self.timeout_s = timeout_s
        self._dead_pids = alive
        self.client = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()

    def check_processes(self) -> None:
        """EngineDead if one of a launched server's processes exited."""
        if self._dead_pids is not None:
            gone = self._dead_pids()
            if gone:
                raise EngineDead(f"vLLM server process(es) {gone} died; open a new engine")

    async def healthy(self) -> bool:
        """Whether the server answers /health with 200 (and its processes run)."""
        import httpx

        if self._dead_pids is not None and self._dead_pids():
            return False
        try:
            response = await self._send("GET", "/health", True, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return bool(response.status_code == 200)

    async def _dead(self, path: str, exc: BaseException | str) -> EngineDead:
        self.check_processes()
        return EngineDead(f"the vLLM server at {self.url} stopped answering ({path}: {exc}); open a new engine")

    async def translate(self, path: str, exc: BaseException) -> BaseException:
        """rlinfer's error for an httpx exception raised by a call to ``path``."""
        import httpx

        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            if await self.healthy():
                return EngineTimeout(f"the vLLM server did not answer {path} within its timeout ({exc!r})")
            return await self._dead(path, exc)
        if isinstance(exc, httpx.TransportError):  # refused, reset, closed mid-answer
            return await self._dead(path, exc)
        return exc

    async def check(self, path: str, response: Any) -> Any:
        """The JSON body of a 2xx answer (None when empty); typed errors otherwise."""
        status = response.status_code
        if status < 300:
            if not response.content:
                return None
            try:
                return response.json()
            except ValueError:
                return response.text
        try:
            body = response.json()
        except ValueError:
            body = response.text
        return await self.error(path, status, body)

    async def error(self, path: str, status: int, body: Any) -> InvalidRequest:
        """The typed error of an error answer (``status`` >= 300, JSON ``body``): InvalidRequest
        for 4xx is returned; EngineDead or ServerError for 5xx are raised."""
        param, message = _error_message(body)
        if status < 500:
            return InvalidRequest(param or "request", f"the vLLM server refused {path} (HTTP {status}): {message}")
        if await self._gone():
            raise await self._dead(path, f"HTTP {status}: {message}")
        raise ServerError(path, status, message)

    async def _gone(self) -> bool:
        """After a 5xx: whether the server is dead. A launched server's processes say it for sure
        (a slow /health on a loaded machine must not turn a failed operation into EngineDead);
        an attached server must answer /health."""
        if self._dead_pids is not None:
            return bool(self._dead_pids())
        return not await self.healthy()

    async def _send(self, method: str, path: str, retry: bool, **kwargs: Any) -> Any:
        """One request; a call that may run twice (``retry``) is sent again once when a pooled
        keep-alive connection turns out closed by the server (uvicorn closes a connection after an
        exception in the app, e.g. a failed ``/collective_rpc``, without telling the client)."""
        import httpx

        for attempt in (0, 1):
            try:
                return await self.client.request(method, path, **kwargs)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                if not retry or attempt:
                    raise
        raise AssertionError("unreachable")

    async def post(
        self,
        path: str,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        retry: bool = True,
        close: bool = False,
    ) -> Any:
        """POST ``body`` as JSON; the answer's JSON. 4xx raises InvalidRequest. ``retry``: the
        call may run twice (see :meth:`_send`); ``close``: on a connection of its own (a call
        that may fail inside the server, which then closes the connection)."""
        self.check_processes()
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        headers = {"Connection": "close"} if close else None
        try:
            response = await self._send("POST", path, retry, json=body, params=params, timeout=timeout, headers=headers)
        except Exception as exc:
            raise await self.translate(path, exc) from exc
        result = await self.check(path, response)
        if isinstance(result, InvalidRequest):
            raise result
        return result

    async def get(self, path: str) -> Any:
        """GET ``path``; the answer's JSON."""
        self.check_processes()
        try:
            response = await self._send("GET", path, True)
        except Exception as exc:
            raise await self.translate(path, exc) from exc
        result = await self.check(path, response)
        if isinstance(result, InvalidRequest):
            raise result
        return result

    async def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Call ``RLInferWorkerExtension.<method>`` in the (first) worker through
        ``/collective_rpc`` -> ``rlinfer_http``; bytes arguments go as :func:`b64`. Sent once (a
        broadcast load cannot run twice) on a connection of its own."""
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        body = {"method": "rlinfer_http", "args": [method, *args], "timeout": timeout}
        result = await self.post(
            "/collective_rpc", body, timeout_s=timeout + CONNECT_TIMEOUT_S, retry=False, close=True
        )
        return result["results"][0] if result is not None else None

    async def ndjson(self, path: str, body: Any) -> AsyncIterator[Any]:
        """POST ``body`` and yield each line's JSON of an NDJSON answer; :class:`RouteMissing` if
        the server has no ``path`` (404). Closing the iterator closes the connection."""
        async with contextlib.aclosing(self._lines(path, body, route_may_be_missing=True)) as lines:
            async for line in lines:
                if line:
                    yield json.loads(line)

    async def stream(self, path: str, body: Any) -> AsyncIterator[Any]:
        """POST ``body`` and yield each server-sent event's JSON (``data: ...``) until ``[DONE]``.

        Closing the iterator closes the connection, which aborts the request in vLLM.
        """
        async with contextlib.aclosing(self._lines(path, body)) as lines:
            async for line in lines:
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return
                yield json.loads(data)

    async def _lines(self, path: str, body: Any, *, route_may_be_missing: bool = False) -> AsyncGenerator[str, None]:
        """POST ``body`` and yield the answer's lines; HTTP errors and connection loss typed."""
        self.check_processes()
        try:
            async with self.client.stream("POST", path, json=body) as response:
                if route_may_be_missing and response.status_code == 404:
                    raise RouteMissing(path)
                if response.status_code >= 300:
                    await response.aread()
                    error = await self.check(path, response)
                    if isinstance(error, InvalidRequest):
                        raise error
                async for line in response.aiter_lines():
                    yield line
        except RLInferError:
            raise
        except GeneratorExit:
            raise
        except Exception as exc:
            translated = await self.translate(path, exc)
            if translated is exc:
                raise
            raise translated from exc
