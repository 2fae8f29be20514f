"""The ``demo`` and ``bench`` subcommands of ``rlinfer`` (entry points of ``rlinfer.commands``).

Registering imports nothing heavy: torch, transformers and the engines load only when a command
runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from rlinfer_core.cli import add_config_arguments, backend_name, config_layers
from rlinfer_core.errors import InvalidRequest


def apply_simple_config(
    args: argparse.Namespace, command: str, honoured: Sequence[str], default_backend: str | None = None
) -> None:
    """For commands that build their own EngineConfig from ``args.model``/``args.dtype``/
    ``args.engine_arg``: fill those from ``--config``/``--set`` and refuse what the command cannot
    honour."""
    settings, overrides = config_layers(args)
    if default_backend and not args.backend and (settings is None or settings.backend is None):
        args.backend = default_backend
    args.backend = backend_name(args, settings)
    fields = {**(settings.fields if settings else {}), **overrides}
    ignored = sorted(set(fields) - set(honoured))
    if ignored:
        raise InvalidRequest(
            ignored[0], f"rlinfer {command} takes only {sorted(honoured)} from --config/--set, not {ignored}"
        )
    if getattr(args, "model", None) is None and "model" in fields:
        args.model = fields["model"]
    if getattr(args, "dtype", None) is None and "dtype" in fields:
        args.dtype = fields["dtype"]
    if "engine_kwargs" in fields:
        args.engine_arg = [f"{k}={json.dumps(v)}" for k, v in dict(fields["engine_kwargs"]).items()] + list(
            getattr(args, "engine_arg", []) or []
        )
    if settings is not None or overrides:
        from rlinfer_core.config_file import engine_config

        engine_config(settings, overrides, defaults={"model": "x"})  # values checked with cattrs


def _cmd_bench(args: argparse.Namespace) -> int:
    # the whole EngineConfig of --config/--set/the flags reaches the engine (rlinfer_demo.bench)
    if args.replicas is not None and args.replicas < 1:
        raise InvalidRequest("replicas", f"must be >= 1, got {args.replicas}")
    from rlinfer_demo.bench import main as bench_main

    return int(bench_main(args))


def _cmd_demo(args: argparse.Namespace) -> int:
    apply_simple_config(args, "demo", ("model",), default_backend="vllm")
    from rlinfer_demo.cli import main as demo_main

    return int(demo_main(args))


def register_bench(subparsers: Any) -> None:
    """``rlinfer bench``: rlinfer vs the raw engine (needs a backend claiming ``bench``)."""
    p = subparsers.add_parser(
        "bench",
        help="rlinfer vs the raw engine (and vs in-process for server mode, vs a pool with --replicas): "
        "generate throughput and weight-update time",
    )
    p.add_argument("--backend", help="backend name (or rollout.name in --config)")
    p.add_argument(
        "--replicas",
        type=int,
        help="also an rlinfer-ray pool of N replicas of the same engine: its overhead (N=1) or scaling (N>1)",
    )
    p.add_argument("--model", help="HF model dir (default: a tiny random model)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5, help="timed runs per side (median reported)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="engine dtype")
    p.add_argument("--json-out", help="write the JSON result here")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine-specific argument passed through EngineConfig.engine_kwargs (repeatable)",
    )
    add_config_arguments(p)
    p.set_defaults(func=_cmd_bench)


def register_demo(subparsers: Any) -> None:
    """``rlinfer demo``: a real GRPO loop through rlinfer."""
    p = subparsers.add_parser("demo", help="a real GRPO loop through rlinfer on the tiny model (or --model)")
    p.add_argument("--backend", default=None, help="backend name (default: rollout.name in --config, else vllm)")
    p.add_argument("--model", help="local HF causal LM dir (default: the tiny model)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default="out/demo")
    p.add_argument(
        "--task",
        choices=["digits", "agent"],
        default="digits",
        help="digits: single-turn GRPO (default); agent: multi-turn sessions with a calculator tool",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the engine's own logs on the terminal (default: written to OUT/engine.log)",
    )
    add_config_arguments(p)
    p.set_defaults(func=_cmd_demo)
