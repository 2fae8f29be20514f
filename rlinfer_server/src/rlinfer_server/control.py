"""Control endpoints under ``/control/`` (all behind the ``--api-key`` bearer token, enforced by
:class:`rlinfer_server.guard.Guard`): weights, pause/resume/abort, memory, state."""

from __future__ import annotations

import time
from typing import Any

import attrs
from fastapi import APIRouter, Depends, Request

from rlinfer_core.errors import InvalidRequest, WeightUpdateError
from rlinfer_core.weights import BroadcastGroup, BroadcastSource, CheckpointDir, TensorSpec, WeightUpdate
from rlinfer_server.app import ServerState
from rlinfer_server.errors import HTTPError
from rlinfer_server.guard import Access
from rlinfer_server.schemas import AbortBody, BroadcastGroupBody, EmptyBody, MemoryBody, PauseBody, UpdateWeightsBody

router = APIRouter(prefix="/control", tags=[Access.CONTROL])


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.rlinfer
    return state


def _source(body: UpdateWeightsBody) -> CheckpointDir | BroadcastSource:
    if body.source == "disk":
        if body.specs is not None:
            raise InvalidRequest("specs", "only for source 'broadcast'")
        if not body.path:
            raise InvalidRequest("path", "source 'disk' needs the checkpoint directory (as the server sees it)")
        return CheckpointDir(body.path)
    if body.path is not None:
        raise InvalidRequest("path", "only for source 'disk'")
    if not body.specs:
        raise InvalidRequest("specs", "source 'broadcast' needs the specs of the tensors, in broadcast order")
    return BroadcastSource(tuple(TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in body.specs))


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsBody, request: Request) -> dict[str, Any]:
    """Load new weights, all or nothing; answers the new version."""
    state = _state(request)
    source = _source(body)
    engine = state.engine
    if body.version is not None and body.version <= engine.weight_version:
        message = f"version {body.version} must be greater than the current version {engine.weight_version}"
        raise HTTPError(409, message, "version", "conflict")
    if "weights" in {str(t) for t in engine.released}:
        raise HTTPError(409, "weights are released; POST /control/resume_memory first", "engine_state", "conflict")
    started = time.perf_counter()
    try:
        version = await state.engine.update_weights(WeightUpdate(source, version=body.version))
    except WeightUpdateError:
        state.metrics.weight_updates.labels(body.source, "failed").inc()
        raise
    seconds = time.perf_counter() - started
    state.metrics.update_seconds.labels(body.source).observe(seconds)
    state.metrics.weight_updates.labels(body.source, "ok").inc()
    state.metrics.weight_version.set(version)
    return {"weight_version": version, "seconds": seconds}


@router.post("/init_weight_broadcast")
async def init_weight_broadcast(body: BroadcastGroupBody, request: Request) -> dict[str, Any]:
    """Join the trainer's broadcast group (returns once the group is formed)."""
    group = BroadcastGroup(**body.model_dump())
    await _state(request).engine.init_weight_broadcast(group)
    return {"ok": True}


@router.post("/pause")
async def pause(body: PauseBody, request: Request) -> dict[str, Any]:
    """Pause generation ("abort", "wait" or "keep")."""
    await _state(request).engine.pause(body.mode)
    return {"ok": True, "mode": body.mode}


async def _no_body_or_object(request: Request) -> None:
    """Endpoints without parameters take no body or ``{}``; FastAPI reads a JSON ``null`` body as
    no body at all, so it is refused here."""
    if (await request.body()).strip() == b"null":
        raise HTTPError(400, "expected no body or a JSON object, got null", "body")


@router.post("/resume", dependencies=[Depends(_no_body_or_object)])
async def resume(request: Request, body: EmptyBody | None = None) -> dict[str, Any]:
    """Resume after pause."""
    await _state(request).engine.resume()
    return {"ok": True}


@router.post("/abort")
async def abort(body: AbortBody, request: Request) -> dict[str, Any]:
    """Abort requests by id (none given: every request in flight)."""
    await _state(request).engine.abort(body.request_ids)
    return {"ok": True}


@router.post("/release_memory")
async def release_memory(body: MemoryBody, request: Request) -> dict[str, Any]:
    """Free accelerator memory for ``tags`` (501 where the platform cannot)."""
    engine = _state(request).engine
    await engine.release_memory(body.tags)
    return {"released": sorted(str(t) for t in engine.released)}


@router.post("/resume_memory")
async def resume_memory(body: MemoryBody, request: Request) -> dict[str, Any]:
    """Re-allocate released memory."""
    engine = _state(request).engine
    await engine.resume_memory(body.tags)
    return {"released": sorted(str(t) for t in engine.released)}


@router.post("/reset_prefix_cache", dependencies=[Depends(_no_body_or_object)])
async def reset_prefix_cache(request: Request, body: EmptyBody | None = None) -> dict[str, Any]:
    """Drop cached prefixes."""
    await _state(request).engine.reset_prefix_cache()
    return {"ok": True}


@router.get("/weight_version")
async def weight_version(request: Request) -> dict[str, Any]:
    """The weight version now served."""
    return {"weight_version": _state(request).engine.weight_version}


@router.get("/weights_checksum")
async def weights_checksum(request: Request) -> dict[str, Any]:
    """Checksums of the served tensors (computed inside the engine), by HF name."""
    sums = await _state(request).engine.weights_checksum()
    return {"checksums": {name: attrs.asdict(c) for name, c in sums.items()}}


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """Backend capabilities, model info, weight specs (for broadcast updates) and state."""
    engine = _state(request).engine
    model = engine.model_info
    specs = [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in engine.weight_specs.values()]
    return {
        "capabilities": engine.capabilities.to_dict(),
        "model_info": None if model is None else {k: getattr(model, k) for k in ("vocab_size", "max_model_len")},
        "weight_specs": specs,
        "weight_version": engine.weight_version,
        "released": sorted(str(t) for t in engine.released),
        "in_flight": len(engine.in_flight),
        "broadcast_ranks": getattr(engine, "broadcast_ranks", 1),
    }
