"""What the engine servers' dialects share: weight updates with rlinfer's checks and metrics,
version labels, model facts, and how rlinfer's typed errors map onto a dialect's status codes.

Engine servers label weight versions with opaque strings; rlinfer's versions are integers that
only move with an update. A dialect's version label must therefore be an integer above the
current version (what slime and TRL send: a step counter).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastapi import Request

from rlinfer_core.errors import (
    EngineDead,
    EngineOutOfMemory,
    EngineTimeout,
    InvalidRequest,
    RLInferError,
    UnsupportedCapability,
    WeightUpdateError,
)
from rlinfer_core.weights import WeightSource, WeightUpdate
from rlinfer_server.app import ServerState


class VersionConflict(InvalidRequest):
    """A version label that is not above the current version, or weights that are released."""


def state_of(request: Request) -> ServerState:
    """The server's shared state."""
    state: ServerState = request.app.state.rlinfer
    return state


def parse_version(label: str | None, field: str = "weight_version") -> int | None:
    """rlinfer's integer version of an engine-server version label (None: current + 1)."""
    if label is None:
        return None
    try:
        return int(label)
    except ValueError:
        raise InvalidRequest(field, f"rlinfer weight versions are integers (a step counter), got {label!r}") from None


async def apply_update(state: ServerState, source: WeightSource, version: int | None, transport: str) -> int:
    """Load ``source`` all or nothing as ``version`` (checked first); answers the new version."""
    engine = state.engine
    if version is not None and version <= engine.weight_version:
        raise VersionConflict(
            "weight_version", f"{version} must be greater than the current version {engine.weight_version}"
        )
    if "weights" in {str(t) for t in engine.released}:
        raise VersionConflict("weights", "are released: resume memory first")
    started = time.perf_counter()
    try:
        new_version = await engine.update_weights(WeightUpdate(source, version=version))
    except WeightUpdateError:
        state.metrics.weight_updates.labels(transport, "failed").inc()
        raise
    state.metrics.update_seconds.labels(transport).observe(time.perf_counter() - started)
    state.metrics.weight_updates.labels(transport, "ok").inc()
    state.metrics.weight_version.set(new_version)
    return new_version


def error_status(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, rlinfer error type) of an error raised by a dialect's control route: engine
    servers answer 400 for a refused request or update; rlinfer keeps 409 for state conflicts,
    501 for what this engine cannot do here, 503 for a dead engine and 504 for a missed deadline;
    a request the KV cache cannot hold: 503 when transient, else 400 (see rlinfer_server.errors)."""
    if isinstance(exc, VersionConflict):
        return 409, "conflict"
    if isinstance(exc, InvalidRequest):
        return 400, "invalid_request_error"
    if isinstance(exc, WeightUpdateError):
        return 400, "weight_update_error"
    if isinstance(exc, UnsupportedCapability):
        return 501, "unsupported_capability"
    if isinstance(exc, EngineOutOfMemory):
        return (503 if exc.transient else 400), "engine_out_of_memory"
    if isinstance(exc, EngineTimeout):
        return 504, "engine_timeout"
    if isinstance(exc, EngineDead):
        return 503, "engine_dead"
    if isinstance(exc, RLInferError):
        return 500, "rlinfer_error"
    return 500, "internal_error"


def hf_config(model: str) -> dict[str, Any]:
    """The model directory's ``config.json`` ({} when unreadable)."""
    try:
        data = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
