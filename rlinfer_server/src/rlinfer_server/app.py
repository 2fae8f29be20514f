"""The ASGI app: :func:`create_app` over anything with the :class:`ServedEngine` API.

The engine is opened in the app's lifespan (inside uvicorn's event loop, where AsyncEngine must
live) and shut down with the server. :class:`ServedEngine` is the part of
:class:`rlinfer_core.engine.AsyncEngine` the routes use, so a pool with the same methods can be
served unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlinfer_core.errors import RLInferError
from rlinfer_core.types import Capabilities, Completion, CompletionDelta, EngineConfig, GenerateRequest
from rlinfer_server import errors
from rlinfer_server.convert import Tokens
from rlinfer_server.guard import Guard
from rlinfer_server.metrics import Metrics
from rlinfer_server.settings import ServerSettings

log = logging.getLogger("rlinfer.server")


class ServedEngine(Protocol):
    """What the server needs from an engine (AsyncEngine has it; a pool can too)."""

    config: EngineConfig
    capabilities: Capabilities

    @property
    def weight_version(self) -> int: ...  # noqa: D102

    @property
    def model_info(self) -> Any: ...  # noqa: D102

    @property
    def weight_specs(self) -> Mapping[str, Any]: ...  # noqa: D102

    @property
    def released(self) -> frozenset[Any]: ...  # noqa: D102

    @property
    def in_flight(self) -> frozenset[str]: ...  # noqa: D102

    @property
    def broadcast_ranks(self) -> int: ...  # noqa: D102

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]: ...  # noqa: D102
    def stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]: ...  # noqa: D102
    async def check_health(self) -> None: ...  # noqa: D102
    async def parse_tool_calls(self, text: str, parser: str, tools: Any = None) -> Any: ...  # noqa: D102
    async def abort(self, request_ids: Sequence[str] | None = None) -> None: ...  # noqa: D102
    async def pause(self, mode: Any = ...) -> None: ...  # noqa: D102
    async def resume(self) -> None: ...  # noqa: D102
    async def update_weights(self, update: Any, *, version: int | None = None) -> int: ...  # noqa: D102
    async def init_weight_broadcast(self, group: Any) -> None: ...  # noqa: D102
    async def release_memory(self, tags: Iterable[Any] | None = None) -> None: ...  # noqa: D102
    async def resume_memory(self, tags: Iterable[Any] | None = None) -> None: ...  # noqa: D102
    async def reset_prefix_cache(self) -> None: ...  # noqa: D102
    async def weights_checksum(self) -> Mapping[str, Any]: ...  # noqa: D102
    async def shutdown(self) -> None: ...  # noqa: D102


class ServerState:
    """What the routes share: the engine, the tokenizer, settings and metrics."""

    def __init__(self, settings: ServerSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._engine: ServedEngine | None = None
        self._tokens: Tokens | None = None

    @property
    def engine(self) -> ServedEngine:
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
    open_engine: Callable[[], Awaitable[ServedEngine]],
    settings: ServerSettings,
    on_ready: Callable[[ServedEngine], None] | None = None,
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
    app.include_router(openai_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(control.router)
    if dialect.router is not None:
        app.include_router(dialect.router)
    app.add_middleware(
        Guard,
        settings=settings,
        metrics=metrics,
        control_paths=dialect.control_paths,
        open_paths=dialect.open_paths,
        known_paths=dialect.paths,
    )
    return app


async def _internal_error(_request: Any, exc: Exception) -> Any:
    log.exception("unexpected error in a request", exc_info=exc)
    return errors.response_for(exc)
