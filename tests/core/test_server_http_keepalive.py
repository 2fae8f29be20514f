"""The server clients never reuse a connection the server may be closing.

uvicorn (under both vLLM's and SGLang's servers) closes a connection idle for
``timeout_keep_alive`` seconds; a client that pools it as long sends, now and then, a request on a
socket the server is closing, which fails with an empty ``ReadError`` (it ended an H100 bench with
128 concurrent requests). The client drops idle connections well before that.

A real uvicorn server on loopback records the client port of each request: the port tells
which pooled connection carried it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
starlette_responses = pytest.importorskip("starlette.responses")

from rlinfer_core.server_http import KEEPALIVE_EXPIRY_S, ServerClient  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def port_echo_server() -> Iterator[str]:
    """A uvicorn server with its default keep-alive whose ``/port`` answers the caller's port."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.routing import Route

    async def port(request: Request) -> starlette_responses.JSONResponse:
        assert request.client is not None
        return starlette_responses.JSONResponse({"port": request.client.port})

    port_number = _free_port()
    config = uvicorn.Config(
        Starlette(routes=[Route("/port", port, methods=["POST", "GET"])]),
        host="127.0.0.1",
        port=port_number,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port_number}"
    server.should_exit = True
    thread.join(timeout=10)


def test_expiry_is_below_the_servers_keep_alive() -> None:
    assert uvicorn.Config(app=None).timeout_keep_alive > KEEPALIVE_EXPIRY_S


def test_idle_connection_is_replaced_before_the_server_closes_it(port_echo_server: str) -> None:
    async def scenario() -> tuple[int, int, int]:
        client = ServerClient(port_echo_server, 10.0, "test")
        try:
            first = (await client.post("/port", {}))["port"]
            again = (await client.post("/port", {}))["port"]
            await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # idle past the client's expiry, not the server's
            after_idle = (await client.post("/port", {}))["port"]
            return first, again, after_idle
        finally:
            await client.aclose()

    first, again, after_idle = asyncio.run(scenario())
    assert again == first, "a busy connection is kept alive"
    assert after_idle != first, "an idle connection is dropped by the client, not reused"
