"""``rlinfer serve`` over a replica's engine: verl's ``server_address``.

With ``custom.rlinfer.http`` (a mapping of ``rlinfer serve``'s settings: ``host``, ``port``,
``api_key``, ``generate_api_key``, ``served_model_name``, ``dialect``, ...), the server actor
also serves rlinfer serve's app (OpenAI API, ``/control``, a dialect) over the same engine, in
its own event loop, and the replica's ``server_address`` is that ``host:port`` (verl's OpenAI
clients, e.g. ``main_generation_server``, post there). The defaults are rlinfer serve's: loopback
(a non-loopback ``host`` needs ``api_key``), and port 0 picks a free port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from rlinfer_core.errors import EngineTimeout, InvalidRequest

#: how long the HTTP server may take to come up (the engine is already running)
START_TIMEOUT_S = 60.0


class HttpFace:
    """rlinfer serve's app on a running engine; :meth:`stop` ends it (and the engine with it)."""

    def __init__(self, server: Any, task: asyncio.Task[Any], host: str, port: int) -> None:
        self._server = server
        self._task = task
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        """``host:port`` as verl writes server addresses (IPv6 in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop serving; the app's shutdown also shuts the engine down."""
        self._server.should_exit = True
        await self._task


async def serve_http(engine: Any, fields: Mapping[str, Any]) -> HttpFace:
    """Start rlinfer serve's app over ``engine`` with the settings ``fields`` (InvalidRequest
    naming a bad one); return once it accepts connections."""
    import attrs
    import uvicorn

    from rlinfer_server.app import create_app
    from rlinfer_server.settings import ServerSettings

    known = {f.name for f in attrs.fields(ServerSettings)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidRequest(f"custom.rlinfer.http.{unknown[0]}", f"unknown key; allowed keys: {sorted(known)}")
    settings = ServerSettings(**{"port": 0, **fields})
    settings.check()
    sock = settings.bind()
    host, port = sock.getsockname()[:2]

    async def open_engine() -> Any:
        return engine

    app = create_app(open_engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise InvalidRequest("custom.rlinfer.http", f"rlinfer serve stopped while starting on {host}:{port}")
        if asyncio.get_running_loop().time() > deadline:
            server.should_exit = True
            raise EngineTimeout(f"rlinfer serve did not start on {host}:{port} within {START_TIMEOUT_S} s")
        await asyncio.sleep(0.05)
    return HttpFace(server, task, str(host), int(port))
