"""``rlinfer serve --dialect sglang``: the routes of ``python -m sglang.launch_server`` that RL
trainers call (slime, AReaL), with SGLang's shapes, over any rlinfer engine or pool.

Generation: ``/generate`` (:mod:`rlinfer_server.sglang_generate`). Control (behind the control
key): ``/update_weights_from_disk``, ``/init_weights_update_group`` +
``/update_weights_from_distributed`` (one torch.distributed broadcast per tensor from the
trainer's rank 0, the group built as SGLang builds it), ``/update_weights_from_tensor`` (tensors
shared by reference: :mod:`rlinfer_core.transfer.shared_tensors`), ``/begin_weight_update`` /
``/end_weight_update`` (accepted; every rlinfer update is all-or-nothing on its own),
``/pause_generation`` / ``/continue_generation``, ``/release_memory_occupation`` /
``/resume_memory_occupation``, ``/flush_cache``, ``/update_weight_version``, ``/abort_request``.
State: ``/server_info`` (``/get_server_info``), ``/model_info`` (``/get_model_info``),
``/get_weight_version``, ``/health_generate``.

Weight routes answer SGLang's ``{success, message}`` (plus ``num_paused_requests`` from disk);
failures keep that shape, with status 400 for a refused request or update as SGLang, and rlinfer's
409 (version not above the current one, released weights), 501 (not possible on this engine and
platform), 503 (engine dead) and 504 (deadline missed), plus ``error_type``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from rlinfer_core.errors import InvalidRequest, RLInferError
from rlinfer_core.types import Completion, FinishReason, PauseMode
from rlinfer_core.weights import BroadcastGroup, BroadcastSource, CheckpointDir, NamedTensors, TensorSpec
from rlinfer_server.app import ServerState
from rlinfer_server.dialect_common import apply_update, error_status, hf_config, parse_version, state_of
from rlinfer_server.dialects import Dialect
from rlinfer_server.guard import Access
from rlinfer_server.sglang_generate import answer_of, answers_of, generate_plan
from rlinfer_server.sglang_schemas import (
    SglAbortBody,
    SglEmptyBody,
    SglGenerateBody,
    SglInitGroupBody,
    SglMemoryBody,
    SglPauseBody,
    SglUpdateFromDiskBody,
    SglUpdateFromDistributedBody,
    SglUpdateFromTensorBody,
    SglWeightVersionBody,
)

router = APIRouter()
control_router = APIRouter(tags=[Access.CONTROL])
open_router = APIRouter(tags=[Access.OPEN])

#: SGLang's pause modes -> rlinfer's: "retract" and "in_place" both keep requests to continue
#: after ``/continue_generation`` (retract frees their KV cache first; rlinfer keeps it)
PAUSE_MODES = {"abort": PauseMode.ABORT, "retract": PauseMode.KEEP, "in_place": PauseMode.KEEP}
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _failure(exc: BaseException, **extra: Any) -> JSONResponse:
    status, kind = error_status(exc)
    message = str(exc) if isinstance(exc, RLInferError) else f"internal error: {type(exc).__name__}"
    return JSONResponse({"success": False, "message": message, "error_type": kind, **extra}, status_code=status)


def _error(exc: BaseException) -> JSONResponse:
    status, kind = error_status(exc)
    message = str(exc) if isinstance(exc, RLInferError) else f"internal error: {type(exc).__name__}"
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


async def _outcome(call: Callable[[], Awaitable[Any]], **extra: Any) -> JSONResponse:
    """``{success, message}`` of a control call; rlinfer errors in the same shape."""
    try:
        message = await call()
    except RLInferError as exc:
        return _failure(exc, **extra)
    return JSONResponse({"success": True, "message": message, **extra})


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: SglGenerateBody, request: Request) -> Any:
    """SGLang's ``/generate`` (one prompt or a batch; ``stream: true`` for one prompt)."""
    state = state_of(request)
    plan = generate_plan(body, state.tokens)
    if body.stream:
        return StreamingResponse(_stream(state, plan), media_type="text/event-stream")
    completions = await state.engine.generate(list(plan.requests))
    return JSONResponse(answers_of(plan, completions, state.tokens))


async def _stream(state: ServerState, plan: Any) -> AsyncIterator[bytes]:
    """SSE chunks as SGLang sends them: each carries the text and ids so far; then ``[DONE]``."""
    import attrs

    (req,) = plan.requests
    (prompt_plan,) = plan.plans
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    try:
        async for delta in state.engine.stream(req):
            ids += delta.token_ids
            logprobs += delta.logprobs
            versions += delta.token_versions or (delta.weight_version,) * len(delta.token_ids)
            so_far = Completion(
                request_id=req.request_id,
                index=0,
                prompt_token_ids=req.prompt_token_ids or (),
                token_ids=tuple(ids),
                logprobs=tuple(logprobs),
                finish_reason=delta.finish_reason or FinishReason.STOP,
                stop_reason=delta.stop_reason,
                weight_version=max(versions, default=delta.weight_version),
                token_versions=tuple(versions),
            )
            chunk = answer_of(attrs.evolve(so_far), prompt_plan, state.tokens, req.request_id)
            if delta.finish_reason is None:
                chunk["meta_info"]["finish_reason"] = None
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    except RLInferError as exc:
        status, kind = error_status(exc)
        error = {"error": {"message": str(exc), "type": kind, "code": status}}
        yield b"data: " + json.dumps(error).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


@control_router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: SglUpdateFromDiskBody, request: Request) -> JSONResponse:
    """Load a checkpoint directory (as the server sees it), all or nothing."""
    state = state_of(request)

    async def run() -> str:
        if body.load_format not in (None, "auto", "safetensors"):
            raise InvalidRequest("load_format", f"only safetensors checkpoints are loaded, got {body.load_format!r}")
        version = parse_version(body.weight_version)
        if body.abort_all_requests:
            await state.engine.abort(None)
        new = await apply_update(state, CheckpointDir(body.model_path), version, "disk")
        return f"Succeeded to update model weights. Weight version updated to {new}."

    return await _outcome(run, num_paused_requests=0)


@control_router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: SglUpdateFromTensorBody, request: Request) -> JSONResponse:
    """Load named tensors shared by reference, all or nothing. This server is one receiver for
    every TP rank, and SGLang's trainers send each rank the same full (unsharded) tensors, so the
    first payload is read."""
    state = state_of(request)

    async def run() -> str:
        from rlinfer_core.transfer.shared_tensors import load_named_tensors

        if body.load_format not in (None, "direct"):
            raise InvalidRequest(
                "load_format", f"only (name, tensor) lists are read (null or 'direct'), got {body.load_format!r}"
            )
        try:
            payload = base64.b64decode(body.serialized_named_tensors[0], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest("serialized_named_tensors", "must be standard base64") from exc
        tensors = await asyncio.to_thread(load_named_tensors, payload)
        version = parse_version(body.weight_version)
        if body.abort_all_requests:
            await state.engine.abort(None)
        new = await apply_update(state, NamedTensors(tuple(tensors)), version, "tensor")
        return f"Succeeded to update model weights. Weight version updated to {new}."

    return await _outcome(run)


@control_router.post("/init_weights_update_group")
async def init_weights_update_group(body: SglInitGroupBody, request: Request) -> JSONResponse:
    """Join the trainer's torch.distributed group (returns once every rank joined)."""
    state = state_of(request)

    async def run() -> str:
        try:
            port = int(body.master_port)
        except ValueError:
            raise InvalidRequest("master_port", f"must be a port number, got {body.master_port!r}") from None
        if body.backend not in ("gloo", "nccl"):
            raise InvalidRequest("backend", f"must be 'gloo' or 'nccl', got {body.backend!r}")
        group = BroadcastGroup(
            master_addr=body.master_address,
            master_port=port,
            world_size=body.world_size,
            backend=body.backend,  # type: ignore[arg-type]
            group_name=body.group_name,
            rank_offset=body.rank_offset,
        )
        await state.engine.init_weight_broadcast(group)
        request.app.state.sglang_group_name = body.group_name
        return "Succeeded to initialize custom process group."

    return await _outcome(run)


@control_router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: SglUpdateFromDistributedBody, request: Request) -> JSONResponse:
    """Receive one broadcast per tensor (``names`` order) from rank 0 and load them, all or nothing."""
    state = state_of(request)

    async def run() -> str:
        joined = getattr(request.app.state, "sglang_group_name", None)
        if joined is None:
            raise InvalidRequest("group_name", "no weight group: POST /init_weights_update_group first")
        if body.group_name != joined:
            raise InvalidRequest("group_name", f"this server joined group {joined!r}, got {body.group_name!r}")
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            raise InvalidRequest("names", "names, dtypes and shapes must have the same length")
        specs = tuple(
            TensorSpec(n, d.removeprefix("torch."), tuple(s))
            for n, d, s in zip(body.names, body.dtypes, body.shapes, strict=True)
        )
        version = parse_version(body.weight_version)
        if body.abort_all_requests:
            await state.engine.abort(None)
        new = await apply_update(state, BroadcastSource(specs), version, "broadcast")
        return f"Succeeded to update parameter online. Weight version updated to {new}."

    return await _outcome(run)


@control_router.post("/begin_weight_update")
async def begin_weight_update(body: SglEmptyBody, request: Request) -> JSONResponse:
    """Accepted for SGLang >= 0.5.23 clients: each rlinfer update is all-or-nothing by itself."""
    state_of(request).engine  # noqa: B018  (503 when the engine is not running)
    return JSONResponse({"success": True, "message": "rlinfer updates are atomic; nothing to open"})


@control_router.post("/end_weight_update")
async def end_weight_update(body: SglEmptyBody, request: Request) -> JSONResponse:
    """Accepted for SGLang >= 0.5.23 clients (see ``/begin_weight_update``)."""
    state_of(request).engine  # noqa: B018
    return JSONResponse({"success": True, "message": "rlinfer updates are atomic; nothing to close"})


@control_router.post("/pause_generation")
async def pause_generation(body: SglPauseBody, request: Request) -> JSONResponse:
    """Pause: ``abort`` ends in-flight requests now; ``retract`` / ``in_place`` keep them for later."""
    try:
        await state_of(request).engine.pause(PAUSE_MODES[body.mode])
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@control_router.post("/continue_generation")
async def continue_generation(body: SglEmptyBody, request: Request) -> JSONResponse:
    """Resume after ``/pause_generation``."""
    try:
        await state_of(request).engine.resume()
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@control_router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request, body: SglMemoryBody | None = None) -> Response:
    """Free accelerator memory for ``tags`` (none: all); 501 where the platform cannot (CPU)."""
    try:
        await state_of(request).engine.release_memory(None if body is None else body.tags)
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse(None)


@control_router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request, body: SglMemoryBody | None = None) -> Response:
    """Re-allocate what ``/release_memory_occupation`` freed."""
    try:
        await state_of(request).engine.resume_memory(None if body is None else body.tags)
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse(None)


@control_router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """Drop cached prefixes (SGLang's text answer)."""
    try:
        await state_of(request).engine.reset_prefix_cache()
    except RLInferError as exc:
        return PlainTextResponse(str(exc), status_code=error_status(exc)[0])
    return PlainTextResponse(FLUSHED)


@control_router.post("/abort_request")
async def abort_request(body: SglAbortBody, request: Request) -> Response:
    """Abort one request (``rid``) or all (``abort_all``); an unknown rid is not an error."""
    engine = state_of(request).engine
    try:
        if body.abort_all:
            await engine.abort(None)
        elif body.rid:
            await engine.abort([body.rid])
    except RLInferError as exc:
        return _error(exc)
    return Response(status_code=200)


@control_router.post("/update_weight_version")
async def update_weight_version(body: SglWeightVersionBody, request: Request) -> JSONResponse:
    """rlinfer versions move only with an update (send ``weight_version`` with it): the current
    version is accepted (a no-op), any other is 409."""
    state = state_of(request)
    try:
        version = parse_version(body.new_version, "new_version")
        current = state.engine.weight_version
        if version != current:
            from rlinfer_server.dialect_common import VersionConflict

            raise VersionConflict(
                "new_version",
                f"rlinfer's version ({current}) changes only with a weight update: send weight_version with "
                "/update_weights_from_disk or /update_weights_from_distributed",
            )
        if body.abort_all_requests:
            await state.engine.abort(None)
    except RLInferError as exc:
        return _failure(exc)
    return JSONResponse(
        {"success": True, "message": f"Weight version updated to {version}", "new_version": body.new_version}
    )


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, Any]:
    """The version now served, as SGLang's string label."""
    return {"weight_version": str(state_of(request).engine.weight_version)}


def _model_info(state: ServerState) -> dict[str, Any]:
    config = state.engine.config
    hf = hf_config(config.model)
    return {
        "model_path": config.model,
        "served_model_name": state.settings.served_model_name,
        "tokenizer_path": config.tokenizer or config.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(state.engine.weight_version),
        "load_format": config.load_format,
        "tool_call_parser": state.settings.tool_call_parser,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    """Model facts (SGLang's ``/model_info`` fields)."""
    return _model_info(state_of(request))


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    """The ServerArgs fields RL trainers read or compare (slime's external-engine check), from the
    engine's config, plus ``rlinfer`` (backend, version, capabilities). A pool's replicas count as
    data parallelism: ``tp_size * pp_size * dp_size`` is the ranks it takes in a weight group, so a
    trainer sizes ``/init_weights_update_group``'s ``world_size`` from it as for one SGLang server."""
    import rlinfer_core

    state = state_of(request)
    engine = state.engine
    config = engine.config
    info = engine.model_info
    ranks = engine.broadcast_ranks
    data_parallel = ranks // (config.tensor_parallel_size * config.pipeline_parallel_size)
    return {
        "model_path": config.model,
        "tokenizer_path": config.tokenizer or config.model,
        "served_model_name": state.settings.served_model_name,
        "dtype": config.dtype,
        "random_seed": config.seed,
        "tp_size": config.tensor_parallel_size,
        "pp_size": config.pipeline_parallel_size,
        "dp_size": data_parallel,
        "ep_size": config.expert_parallel_size,
        "moe_dp_size": 1,
        "nnodes": 1,
        "node_rank": 0,
        "num_gpus": ranks if config.device != "cpu" else 0,
        "context_length": getattr(info, "max_model_len", None) or config.max_model_len,
        "max_running_requests": config.max_num_seqs,
        "disable_radix_cache": not config.enable_prefix_caching,
        "enable_memory_saver": config.enable_memory_release,
        "enable_return_routed_experts": config.enable_routed_experts,
        "enable_return_hidden_states": config.enable_hidden_states,
        "disaggregation_mode": "null",
        "encoder_only": False,
        "skip_tokenizer_init": False,
        "load_format": config.load_format,
        "host": state.settings.host,
        "port": state.settings.port,
        "weight_version": str(engine.weight_version),
        "version": f"rlinfer-{rlinfer_core.__version__}",
        "internal_states": [{"weight_version": str(engine.weight_version)}],
        "rlinfer": {"capabilities": engine.capabilities.to_dict(), "broadcast_ranks": ranks},
    }


@open_router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 while the engine serves, 503 otherwise (empty bodies, as SGLang)."""
    try:
        await state_of(request).engine.check_health()
    except RLInferError:
        return Response(status_code=503)
    return Response(status_code=200)


DIALECT = Dialect("sglang", (router, control_router, open_router))
