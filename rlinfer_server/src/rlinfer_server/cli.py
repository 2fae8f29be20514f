"""``rlinfer serve``: registered on the ``rlinfer`` command through ``rlinfer.commands``.

This module stays light (no FastAPI, uvicorn or engine import) so that ``rlinfer backends`` and
``rlinfer --help`` stay fast; :func:`run` imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rlinfer_server.settings import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, GENERATE_API_KEY_ENV, ServerSettings


def register(subparsers: Any) -> None:
    """Add ``serve`` to the ``rlinfer`` command."""
    from rlinfer_core.cli import add_config_arguments

    p = subparsers.add_parser(
        "serve", help="serve a backend over HTTP: OpenAI-compatible generation plus guarded control endpoints"
    )
    p.add_argument("--backend", help="backend name (or rollout.name in --config)")
    p.add_argument("--model", help="model directory (or rollout.model in --config)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="engine dtype")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; others need --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one; see --ready-file)")
    p.add_argument("--api-key", help=f"bearer token of the control endpoints (default: ${API_KEY_ENV})")
    p.add_argument(
        "--generate-api-key",
        help=f"bearer token of generation, /v1/models and /metrics (default: ${GENERATE_API_KEY_ENV}; unset: open)",
    )
    p.add_argument("--served-model-name", help="the model name clients send (default: --model as given)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="largest request body")
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "qwen", "llama"],
        help="read tool calls from chat answers (tool_choice auto) with the engine's parser of this format",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's flag, accepted for compatibility (needs --tool-call-parser, which alone enables it)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (refused otherwise, as in vLLM)",
    )
    p.add_argument(
        "--dialect",
        choices=["openai", "sglang", "vllm"],
        default="openai",
        help="also speak an engine server's own HTTP dialect: sglang (python -m sglang.launch_server's "
        "/generate, weight and pause routes) or vllm (vllm serve's RL dev-mode routes); default openai only",
    )
    p.add_argument(
        "--open-control",
        action="store_true",
        help="serve the control routes without a key when no --api-key is set (as vLLM's dev mode and "
        "SGLang without --api-key do); refused unless the server binds a loopback address",
    )
    p.add_argument("--ready-file", help="write {host, port, pid} as JSON here once the engine serves")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine-specific argument passed through EngineConfig.engine_kwargs (repeatable)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        help="serve an rlinfer-ray pool of N engine replicas (or pool.replicas in --config; needs rlinfer-ray)",
    )
    p.add_argument(
        "--routing",
        choices=["least_outstanding", "round_robin", "session"],
        help="the pool's routing policy (or pool.policy in --config)",
    )
    add_config_arguments(p)
    p.set_defaults(func=run)


def pool_settings(args: argparse.Namespace, file_settings: Any) -> Any:
    """The PoolConfig to serve, or None for one engine: ``--replicas``/``--routing`` over the
    config file's ``pool:`` section; a pool only when ``--replicas`` or that section is given."""
    from rlinfer_core.errors import InvalidRequest

    replicas = getattr(args, "replicas", None)
    routing = getattr(args, "routing", None)
    has_section = file_settings is not None and file_settings.pool is not None
    if replicas is None and not has_section:
        if routing is not None:
            raise InvalidRequest("routing", "only for a pool: give --replicas N (or a pool: section in --config)")
        return None
    try:
        from rlinfer_ray.config_file import pool_config
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in ("rlinfer_ray", "ray"):
            raise
        what = "--replicas" if replicas is not None else "the pool: section of --config"
        raise InvalidRequest("replicas", f"{what} needs rlinfer-ray installed ({exc})") from None
    return pool_config(file_settings, {"replicas": replicas, "routing": routing})


def settings_from_args(args: argparse.Namespace, model: str) -> ServerSettings:
    """Server settings from the command line and the environment, checked."""
    from rlinfer_core.errors import InvalidRequest

    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise InvalidRequest("enable_auto_tool_choice", "needs --tool-call-parser")
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        generate_api_key=args.generate_api_key or os.environ.get(GENERATE_API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        served_model_name=args.served_model_name or model,
        tool_call_parser=getattr(args, "tool_call_parser", None),
        trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)),
        dialect=getattr(args, "dialect", None) or "openai",
        open_control=bool(getattr(args, "open_control", False)),
    )
    settings.check()
    return settings


def run(args: argparse.Namespace) -> int:
    """Check everything, bind, open the engine in the server's loop, serve until SIGINT/SIGTERM."""
    from rlinfer_core.cli import backend_name, config_layers
    from rlinfer_core.config_file import engine_config
    from rlinfer_core.types import parse_assignments

    engine_args = parse_assignments(args.engine_arg or [], "--engine-arg")
    flags = {"model": args.model, "dtype": args.dtype, "engine_kwargs": engine_args or None}
    file_settings, overrides = config_layers(args, flags)
    backend = backend_name(args, file_settings)
    config = engine_config(file_settings, overrides)
    pool = pool_settings(args, file_settings)
    settings = settings_from_args(args, config.model)
    sock = settings.bind()  # before the engine starts: a taken port fails in a second, not minutes
    host, port = sock.getsockname()[:2]

    import uvicorn

    from rlinfer_core.discovery import get_backend
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_server.app import create_app

    get_backend(backend).engine_version()  # fail fast on a missing engine

    async def open_engine() -> AsyncEngine:
        if pool is not None:
            from rlinfer_ray import open_async_pool

            return await open_async_pool(backend, config, pool=pool)
        return await AsyncEngine.open(backend, config)

    what = backend if pool is None else f"a pool of {pool.replicas} {backend} replicas ({pool.policy.value})"

    def ready(_engine: AsyncEngine) -> None:
        print(f"rlinfer serve: {what} serving {settings.served_model_name!r} on http://{host}:{port}", flush=True)
        if args.ready_file:
            path = Path(args.ready_file)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"host": host, "port": port, "pid": os.getpid()}))
            tmp.replace(path)

    if settings.api_key is None and settings.open_control:
        print("rlinfer serve: --open-control: control endpoints open to anyone on this machine", file=sys.stderr)
    elif settings.api_key is None:
        print("rlinfer serve: no --api-key: the control endpoints are disabled", file=sys.stderr)
    app = create_app(open_engine, settings, on_ready=ready)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=30, access_log=False)
    )
    server.run(sockets=[sock])
    return 0 if server.started else 1
