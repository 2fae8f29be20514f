"""The ``rlinfer`` command: ``backends``, ``bench``, ``conformance``, ``demo``.

Subcommands import their heavy modules only when run, so ``rlinfer backends`` stays fast and
imports neither torch nor any engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from rlinfer_core.discovery import discover
from rlinfer_core.errors import RLInferError


def backends_report() -> dict[str, Any]:
    """Every discovered backend with its engine version and capabilities, and load failures."""
    found = discover()
    rows = []
    for name, info in sorted(found.backends.items()):
        row: dict[str, Any] = {
            "name": name,
            "summary": info.summary,
            "engine_requirements": list(info.engine_requirements),
        }
        try:
            dist, version = info.engine_version()
            row.update(engine=dist, engine_version=version, usable=True)
            row["capabilities"] = info.describe().to_dict()
        except RLInferError as exc:
            row.update(usable=False, error=str(exc))
        except Exception as exc:  # a backend's describe() must not break the listing
            row.update(usable=False, error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    failures = [
        {"group": f.group, "name": f.name, "entry_point": f.value, "distribution": f.distribution, "error": f.error}
        for f in found.failures
    ]
    return {"backends": rows, "plugins": sorted(found.plugins), "load_errors": failures}


def _cmd_backends(args: argparse.Namespace) -> int:
    report = backends_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="rlinfer backends")
    for col in ("backend", "engine", "platform", "supported", "not supported"):
        table.add_column(col, overflow="fold")
    for row in report["backends"]:
        if not row["usable"]:
            table.add_row(row["name"], "[red]unusable[/red]", "", row["error"], "")
            continue
        caps = row["capabilities"]
        table.add_row(
            row["name"],
            f"{row['engine']} {row['engine_version']}",
            caps["platform"],
            ", ".join(caps["supported"]),
            ", ".join(caps["unsupported"]),
        )
    console.print(table)
    for err in report["load_errors"]:
        console.print(
            f"[red]failed to load[/red] {err['group']}:{err['name']} from {err['distribution']}: {err['error']}"
        )
    if not report["backends"]:
        console.print("No backend installed: `pip install rlinfer-vllm[cpu]` or `pip install rlinfer-sglang`.")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from rlinfer_core.bench import main as bench_main

    return int(bench_main(args))


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        from rlinfer_conformance.runner import main as conformance_main
    except ImportError:
        print("rlinfer conformance needs the kit: pip install rlinfer-conformance", file=sys.stderr)
        return 2
    return int(conformance_main(args))


def _cmd_demo(args: argparse.Namespace) -> int:
    from rlinfer_core.demo.cli import main as demo_main

    return int(demo_main(args))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``rlinfer`` command."""
    parser = argparse.ArgumentParser(prog="rlinfer", description="One contract for RL rollout engines.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends, engine versions, capabilities, load errors")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("bench", help="rlinfer vs the raw engine: generate throughput and weight-update time")
    p.add_argument("--backend", required=True)
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
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("conformance", help="run the conformance kit against a backend")
    p.add_argument("--backend", required=True)
    p.add_argument("--report", help="write the JSON report here")
    p.add_argument("--profile", default="ci", choices=["ci", "thorough"], help="hypothesis profile")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    p.set_defaults(func=_cmd_conformance)

    p = sub.add_parser("demo", help="a real GRPO loop through rlinfer on the tiny model (or --model)")
    p.add_argument("--backend", default="vllm")
    p.add_argument("--model", help="local HF causal LM dir (default: the tiny model)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default="out/demo")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlinfer`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except RLInferError as exc:
        print(f"rlinfer: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
