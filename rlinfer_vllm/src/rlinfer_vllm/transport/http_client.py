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

from rlinfer_core import server_http
from rlinfer_core.errors import InvalidRequest, RLInferError
from rlinfer_core.server_http import CONNECT_TIMEOUT_S, HEALTH_TIMEOUT_S


class RouteMissing(RLInferError):
    """The server answered 404 for a route (an attached server without rlinfer's middleware)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"the vLLM server has no {path}")


def b64(data: bytes) -> dict[str, str]:
    """A bytes argument for :meth:`ServerClient.rpc` (decoded by the worker's ``rlinfer_http``)."""
    return {"b64": base64.b64encode(data).decode("ascii")}


class ServerClient(server_http.ServerClient):
    """The core's client bound to a vLLM server (typed errors, process and /health liveness),
    plus what vLLM's server needs: a resend over a keep-alive connection the server closed,
    calls on a connection of their own, worker RPCs, NDJSON and SSE answers. ``alive`` returns
    the pids of a launched server's processes that exited (attached servers: None)."""

    def __init__(self, url: str, timeout_s: float, alive: Callable[[], list[int]] | None = None) -> None:
        super().__init__(url, timeout_s, "vLLM", dead_pids=alive)

    async def healthy(self) -> bool:
        """Whether the server answers /health with 200 (and its processes run); the probe is
        resent once over a connection the server closed."""
        import httpx

        if self._dead_pids is not None and self._dead_pids():
            return False
        try:
            response = await self._send("GET", self.health_path, True, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return bool(response.status_code == 200)

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

    async def get(self, path: str, timeout_s: float | None = None) -> Any:
        """GET ``path``; the answer's JSON (resent once over a connection the server closed)."""
        return await self._get(path, timeout_s, optional=False)

    async def get_optional(self, path: str, timeout_s: float | None = None) -> Any:
        """GET ``path``; :class:`RouteMissing` if the server has no such route (404)."""
        return await self._get(path, timeout_s, optional=True)

    async def _get(self, path: str, timeout_s: float | None, optional: bool) -> Any:
        self.check_processes()
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            response = await self._send("GET", path, True, timeout=timeout)
        except Exception as exc:
            raise await self.translate(path, exc) from exc
        if optional and response.status_code == 404:
            raise RouteMissing(path)
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
        async with self.typed_errors(path), self.client.stream("POST", path, json=body) as response:
            if route_may_be_missing and response.status_code == 404:
                raise RouteMissing(path)
            if response.status_code >= 300:
                await response.aread()
                error = await self.check(path, response)
                if isinstance(error, InvalidRequest):
                    raise error
            async for line in response.aiter_lines():
                yield line
