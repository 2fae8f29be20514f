"""The ASGI app: :func:`create_app` over one :class:`rlinfer_core.engine.AsyncEngine` (an engine,
or a pool: ``rlinfer_ray.open_pool`` returns the same facade).

The engine is opened in the app's lifespan (inside uvicorn's event loop, where AsyncEngine must
live) and shut down with the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlinfer_core.errors import RLInferError
from rlinfer_server import errors
from rlinfer_server.convert import Tokens
from rlinfer_server.guard import Guard, route_access
from rlinfer_server.metrics import Metrics
from rlinfer_server.settings import ServerSettings

if TYPE_CHECKING:
    from rlinfer_core.engine import AsyncEngine

log = logging.getLogger("rlinfer.server")


class ServerState:
    """What the routes share: the engine, the tokenizer, settings and metrics."""

    def __init__(self, settings: ServerSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._engine: AsyncEngine | None = None
        self._tokens: Tokens | None = None

    @property
    def engine(self) -> AsyncEngine:
        """The engine (raises EngineDead outside the lifespan)."""
        if self._engine is None:
            from rlinfer_core.errors import EngineDead

            raise EngineDead("the server's engine is not running")
        return self._engine

    @property
    def tokens(self) -> Tokens:
        """The model's tokenizer."""
        assert self._tokens is not None
        return self._tokens


def create_app(
    open_engine: Callable[[], Awaitable[AsyncEngine]],
    settings: ServerSettings,
    on_ready: Callable[[AsyncEngine], None] | None = None,
) -> FastAPI:
    """Build the app; ``open_engine`` runs at startup, ``on_ready`` once the engine serves."""
    metrics = Metrics()
    state = ServerState(settings, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine = await open_engine()
        try:
            config = engine.config
            state._tokens = await asyncio.to_thread(Tokens.load, config.tokenizer or config.model)
            state._engine = engine
            metrics.weight_version.set(engine.weight_version)
            if on_ready is not None:
                on_ready(engine)
            yield
        finally:
            state._engine = None
            await engine.shutdown()

    app = FastAPI(title="rlinfer serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.rlinfer = state
    app.add_exception_handler(RequestValidationError, errors.validation_handler)
    app.add_exception_handler(errors.HTTPError, errors.http_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.starlette_error_handler)
    app.add_exception_handler(RLInferError, errors.rlinfer_error_handler)
    app.add_exception_handler(Exception, _internal_error)

    from rlinfer_server import control, openai_api, tokenize_api
    from rlinfer_server.dialects import dialect_named

    dialect = dialect_named(settings.dialect)
    routers = (openai_api.open_router, openai_api.router, tokenize_api.router, control.router, *dialect.routers)
    for router in routers:
        app.include_router(router)
    routes = route_access(route for router in routers for route in router.routes)
    app.add_middleware(Guard, settings=settings, metrics=metrics, routes=routes)
    return app


async def _internal_error(_request: Any, exc: Exception) -> Any:
    log.exception("unexpected error in a request", exc_info=exc)
    return errors.response_for(exc)
