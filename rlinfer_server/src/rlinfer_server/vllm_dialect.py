"""``rlinfer serve --dialect vllm``: the RL routes of ``vllm serve`` in dev mode
(``VLLM_SERVER_DEV_MODE=1``; ``vllm/entrypoints/rl/online/api_router.py``) and its token-in
endpoint ``/inference/v1/generate``, with vLLM's shapes, over any rlinfer engine or pool.

Control (behind the control key): ``/pause?mode=abort|wait|keep``, ``/resume``,
``/abort_requests``, ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``, the weight-transfer
lifecycle ``/init_weight_transfer_engine`` -> ``/start_weight_update`` -> ``/update_weights``* ->
``/finish_weight_update`` (409 out of order, as vLLM's state machine), ``/update_weight_version``.
State: ``/is_paused``, ``/is_sleeping``, ``/get_world_size``, ``/server_info``, ``/weight_info``.

Weight transfer (:mod:`rlinfer_server.vllm_weights`): the server joins the trainer's group as one
rank, whatever the engine's TP/PP/DP or replicas (so ``/get_world_size`` answers 1), and receives
each ``/update_weights`` call's tensors on vLLM's own wire (StatelessProcessGroup rendezvous +
NCCL, one broadcast per tensor or packed buffers; a gloo variant on CPU);
``/finish_weight_update`` loads everything received since ``/start_weight_update`` as one rlinfer
update, all or nothing, labelled with its ``weight_version``.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, Response

from rlinfer_core.capability import Capabilities, Capability
from rlinfer_core.errors import EngineTimeout, RLInferError, UnsupportedCapability
from rlinfer_core.types import EngineConfig, MemoryTag, PauseMode
from rlinfer_server.dialect_common import VersionConflict, error_status, parse_version, state_of
from rlinfer_server.dialects import Dialect
from rlinfer_server.guard import Access
from rlinfer_server.vllm_generate import VllmGenerateBody, generate_answer, generate_requests
from rlinfer_server.vllm_weights import default_weight_backend, session_of

router = APIRouter()
control_router = APIRouter(tags=[Access.CONTROL])


def _error(exc: BaseException) -> JSONResponse:
    status, kind = error_status(exc)
    message = str(exc) if isinstance(exc, RLInferError) else f"internal error: {type(exc).__name__}"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


@control_router.post("/pause")
async def pause(
    request: Request,
    mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
    clear_cache: Annotated[bool, Query()] = True,
) -> JSONResponse:
    """Pause generation; ``clear_cache`` (deprecated in vLLM) is accepted and ignored."""
    try:
        await state_of(request).engine.pause(PauseMode(mode))
    except RLInferError as exc:
        return _error(exc)
    request.app.state.vllm_paused = True
    return JSONResponse({"status": "paused"})


@control_router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    """Resume after ``/pause``."""
    try:
        await state_of(request).engine.resume()
    except RLInferError as exc:
        return _error(exc)
    request.app.state.vllm_paused = False
    return JSONResponse({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, bool]:
    """Whether this dialect's ``/pause`` is in effect."""
    state_of(request).engine  # noqa: B018  (503 when the engine is not running)
    return {"is_paused": bool(getattr(request.app.state, "vllm_paused", False))}


@control_router.post("/abort_requests")
async def abort_requests(request: Request) -> JSONResponse:
    """Abort ``request_ids`` (none or empty: every request in flight)."""
    import json

    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return JSONResponse({"error": {"message": "Invalid JSON format", "code": 400}}, status_code=400)
    if not isinstance(body, dict):
        return JSONResponse({"error": {"message": "Request body must be a JSON object", "code": 400}}, status_code=400)
    ids = body.get("request_ids")
    engine = state_of(request).engine
    targets = [str(i) for i in ids] if ids else sorted(engine.in_flight)
    try:
        await engine.abort(targets if ids else None)
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"status": "aborted", "aborted": len(targets)})


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: Annotated[bool, Query()] = True) -> dict[str, int]:
    """The ranks this server takes in a weight group: 1. vLLM answers TP x PP (x DP), the workers
    that each join; here the server process receives once for every worker and replica, and
    trainers size the group from this answer (TRL: ``world_size = get_world_size() + 1``)."""
    state_of(request).engine  # noqa: B018  (503 when the engine is not running)
    return {"world_size": 1}


@router.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    """vLLM's ``/server_info?config_format=json`` shape: the engine config under ``vllm_config``
    in vLLM's sections (TRL reads ``model_config.logprobs_mode`` and ``weight_transfer_config``),
    and rlinfer's own facts. ``weight_transfer_config`` names the transport ``/init_weight_transfer_engine``
    uses by default: vLLM's NCCL wire where CUDA is available, else the gloo variant."""
    import rlinfer_core

    state = state_of(request)
    engine = state.engine
    return {
        "vllm_config": vllm_config_sections(engine.config, engine.capabilities, state.settings.served_model_name),
        "rlinfer": {
            "version": rlinfer_core.__version__,
            "capabilities": engine.capabilities.to_dict(),
            "weight_version": engine.weight_version,
            "weight_transfer": "vLLM's NCCL wire (or gloo on CPU), one rank per server",
        },
    }


def vllm_config_sections(config: EngineConfig, capabilities: Capabilities, served_name: str) -> dict[str, Any]:
    """An engine config as vLLM's ``VllmConfig`` JSON sections (the fields rlinfer has)."""
    lora = capabilities.supports(Capability.LORA)
    return {
        "model_config": {
            "model": config.model,
            "tokenizer": config.tokenizer or config.model,
            "served_model_name": served_name,
            "dtype": config.dtype,
            "seed": config.seed,
            "max_model_len": config.max_model_len,
            # the default; a request may ask for raw logprobs (``logprobs_mode``)
            "logprobs_mode": "processed_logprobs",
            "enable_return_routed_experts": config.enable_routed_experts,
        },
        "cache_config": {
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
        },
        "parallel_config": {
            "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size,
            "data_parallel_size": config.data_parallel_size,
            "enable_expert_parallel": config.expert_parallel_size > 1,
        },
        "scheduler_config": {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_chunked_prefill": config.enable_chunked_prefill,
        },
        "load_config": {"load_format": config.load_format},
        "device_config": {"device": config.device},
        "lora_config": {"max_lora_rank": config.engine_kwargs.get("max_lora_rank")} if lora else None,
        "weight_transfer_config": {"backend": default_weight_backend(config)},
    }


@control_router.post("/sleep")
async def sleep(
    request: Request,
    level: Annotated[int, Query()] = 1,
    mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
) -> Response:
    """Release the engine's accelerator memory (weights and KV cache); 501 where the platform
    cannot (CPU). ``mode`` is accepted as vLLM's (requests are handled by the engine's release)."""
    try:
        await state_of(request).engine.release_memory(None)
    except RLInferError as exc:
        return _error(exc)
    return Response(status_code=200)


@control_router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> Response:
    """Re-allocate released memory (``tags``: weights, kv_cache; none: all)."""
    try:
        await state_of(request).engine.resume_memory(tags or None)
    except RLInferError as exc:
        return _error(exc)
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    """Whether any memory is released."""
    return {"is_sleeping": bool(state_of(request).engine.released)}


@control_router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    request: Request,
    reset_running_requests: Annotated[bool, Query()] = False,
    reset_external: Annotated[bool, Query()] = False,
) -> JSONResponse:
    """Drop cached prefixes (SkyRL's JSON body is accepted and ignored, as vLLM does)."""
    try:
        await state_of(request).engine.reset_prefix_cache()
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"success": True})


@control_router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(
    request: Request, init_info: Annotated[dict[str, Any], Body(embed=True)]
) -> JSONResponse:
    """Join the trainer's weight group (blocks until every rank joined)."""
    try:
        await session_of(request.app).init(state_of(request), init_info)
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"message": "Weight transfer initialized"})


@control_router.post("/start_weight_update")
async def start_weight_update(request: Request) -> JSONResponse:
    """Open an update (the body, e.g. ``{"is_checkpoint_format": true}``, is ignored as in vLLM)."""
    try:
        session_of(request.app).start(state_of(request))
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"message": "Weight update started"})


@control_router.post("/update_weights")
async def update_weights(request: Request, update_info: Annotated[Any, Body(embed=True)]) -> JSONResponse:
    """Receive the tensors of ``update_info`` (``names``, ``dtype_names``, ``shapes``; or a list of
    such chunks) broadcast by rank 0, in order."""
    try:
        await session_of(request.app).receive(update_info)
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"message": "Weights updated"})


@control_router.post("/finish_weight_update")
async def finish_weight_update(
    request: Request, weight_version: Annotated[str | None, Body(embed=True)] = None
) -> JSONResponse:
    """Load everything received since ``/start_weight_update``, all or nothing."""
    try:
        await session_of(request.app).finish(state_of(request), parse_version(weight_version))
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"message": "Weight update finished"})


#: SkyRL's worker-extension methods (``POST /collective_rpc``), each served by what does the same here
SKYRL_METHODS = (
    "skyrl_start_weight_update",
    "update_weights_nccl",
    "skyrl_finish_weight_update",
    "skyrl_sleep_for_weight_sync",
    "skyrl_wake_for_weight_sync",
)


@control_router.post("/collective_rpc")
async def collective_rpc(
    request: Request,
    method: Annotated[str, Body()],
    args: Annotated[list[Any], Body()] = [],  # noqa: B006  (FastAPI copies defaults)
    kwargs: Annotated[dict[str, Any], Body()] = {},  # noqa: B006
    timeout: Annotated[float | None, Body()] = None,
) -> JSONResponse:
    """The RPCs trainers send to vLLM's workers, where a trainer needs them: SkyRL's weight-sync
    methods (:data:`SKYRL_METHODS`) map onto this server's weight session and memory control.
    There are no vLLM workers to call here, so any other method is 501. Answers vLLM's
    ``{"results": [...]}``, one result (the server is one rank)."""
    state, session = state_of(request), session_of(request.app)

    async def call() -> None:
        if method == "skyrl_start_weight_update":
            session.start(state)
        elif method == "update_weights_nccl":
            await session.receive(kwargs.get("update_info", args[0] if args else None))
        elif method == "skyrl_finish_weight_update":
            await session.finish(state, None)
        elif method == "skyrl_sleep_for_weight_sync":
            if kwargs.get("offload_kv", True):
                await state.engine.release_memory([MemoryTag.KV_CACHE])
        elif method == "skyrl_wake_for_weight_sync":
            await state.engine.resume_memory(kwargs.get("tags") or None)
        else:
            raise UnsupportedCapability(
                f"collective_rpc.{method}",
                "rlinfer serve",
                f"rlinfer serve runs no vLLM workers to call; served methods: {list(SKYRL_METHODS)}",
            )

    try:
        await asyncio.wait_for(call(), timeout=timeout)
    except TimeoutError:
        return _error(EngineTimeout(f"collective_rpc {method} took longer than {timeout} s"))
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"results": [None]})


@control_router.post("/update_weight_version")
async def update_weight_version(request: Request, new_version: Annotated[str, Body(embed=True)]) -> JSONResponse:
    """The current version is accepted (a no-op); rlinfer versions move only with an update
    (``weight_version`` of ``/finish_weight_update``), so any other is 409."""
    try:
        current = state_of(request).engine.weight_version
        if parse_version(new_version, "new_version") != current:
            raise VersionConflict(
                "new_version",
                f"rlinfer's version ({current}) changes only with a weight update: "
                "send weight_version to /finish_weight_update",
            )
    except RLInferError as exc:
        return _error(exc)
    return JSONResponse({"success": True, "new_version": new_version})


@router.get("/weight_info")
async def weight_info(request: Request) -> dict[str, str]:
    """The version now served, as vLLM's string label."""
    return {"weight_version": str(state_of(request).engine.weight_version)}


@router.post("/inference/v1/generate")
async def inference_generate(body: VllmGenerateBody, request: Request) -> JSONResponse:
    """Token ids in; ``token_ids``, ``logprobs`` and ``weight_versions`` spans out, per choice."""
    state = state_of(request)
    routes = state.engine.capabilities.supports(Capability.GENERATE_ROUTED_EXPERTS)
    generate_request = generate_requests(body, routes)
    completions = await state.engine.generate([generate_request])
    return JSONResponse(generate_answer(body, generate_request, completions, state.settings.served_model_name))


DIALECT = Dialect("vllm", (router, control_router))
