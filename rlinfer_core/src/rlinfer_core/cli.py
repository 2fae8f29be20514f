"""The ``rlinfer`` command. ``backends`` is built in; every other subcommand comes from the
``rlinfer.commands`` entry-point group.

Each entry point names a function ``register(subparsers)`` that adds one or more subcommands
(``subparsers.add_parser(...)`` with ``set_defaults(func=...)``), like simonw/llm's
``register_commands``. ``rlinfer-demo`` adds ``demo`` and ``bench`` this way,
``rlinfer-conformance`` adds ``conformance`` and ``rlinfer-server`` adds ``serve``. A command
plugin that fails to load or register is listed under ``load_errors`` by ``rlinfer backends`` and never breaks the CLI.
``RLINFER_COMMANDS`` (comma-separated names) restricts which entry points load.

Subcommands import their heavy modules only when run, so ``rlinfer backends`` stays fast and
imports neither torch nor any engine.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlinfer_core.discovery import LoadFailure, discover
from rlinfer_core.errors import InvalidRequest, RLInferError

COMMANDS_GROUP = "rlinfer.commands"
COMMANDS_ENV = "RLINFER_COMMANDS"
BUILTIN_COMMANDS = ("backends",)


def load_commands(subparsers: Any) -> list[LoadFailure]:
    """Call every ``rlinfer.commands`` entry point with ``subparsers``; return what failed."""
    raw = os.environ.get(COMMANDS_ENV, "").strip()
    allowed = {n.strip() for n in raw.split(",") if n.strip()} if raw else None
    failures: list[LoadFailure] = []
    seen: set[str] = set()
    for ep in sorted(md.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        if allowed is not None and ep.name not in allowed:
            continue
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown distribution"
        problem: str | None = None
        if ep.name in seen or ep.name in BUILTIN_COMMANDS:
            problem = f"duplicate command entry point name {ep.name!r} (first one kept)"
        else:
            before = set(subparsers.choices)
            try:
                register = ep.load()
                if not callable(register):
                    raise TypeError(f"entry point must name a function register(subparsers), got {register!r}")
                register(subparsers)
            except Exception as exc:  # one broken command must never break the others
                problem = f"{type(exc).__name__}: {exc}"
                for name in set(subparsers.choices) - before:  # drop what it half-registered
                    _remove_subparser(subparsers, name)
        if problem is None:
            seen.add(ep.name)
        else:
            failures.append(LoadFailure(COMMANDS_GROUP, ep.name, ep.value, dist, problem))
    return failures


def _remove_subparser(subparsers: Any, name: str) -> None:
    subparsers.choices.pop(name, None)
    subparsers._choices_actions[:] = [a for a in subparsers._choices_actions if a.dest != name]


def _command_failures() -> list[LoadFailure]:
    sub = argparse.ArgumentParser(add_help=False).add_subparsers()
    for name in BUILTIN_COMMANDS:
        sub.add_parser(name)
    return load_commands(sub)


def backends_report() -> dict[str, Any]:
    """Every discovered backend with its engine version and capabilities, and load failures
    (of backends, observer plugins and command plugins)."""
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
            from rlinfer_core.agent import derive_capabilities  # sessions, score: built by the facade

            row["capabilities"] = derive_capabilities(info.describe()).to_dict()
        except RLInferError as exc:
            row.update(usable=False, error=str(exc))
        except Exception as exc:  # a backend's describe() must not break the listing
            row.update(usable=False, error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    failures = [
        {"group": f.group, "name": f.name, "entry_point": f.value, "distribution": f.distribution, "error": f.error}
        for f in (*found.failures, *_command_failures())
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
        console.print("No backend installed: `pip install rlinfer-vllm` or `pip install rlinfer-sglang` (GPU).")
    return 0


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``--set FIELD=VALUE`` (EngineConfig fields; flags beat the file)."""
    parser.add_argument("--config", metavar="FILE", help="YAML or TOML file with a rollout: section (EngineConfig)")
    parser.add_argument(
        "--set",
        dest="config_set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an EngineConfig field (JSON value), overriding the config file (repeatable)",
    )


def config_layers(args: argparse.Namespace, flags: Mapping[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The config file's settings (or None) and the command-line fields that override it:
    ``--set`` items, then the explicit ``flags`` (None values mean "not given")."""
    from rlinfer_core.config_file import read_config_file
    from rlinfer_core.types import parse_assignments

    settings = read_config_file(args.config) if getattr(args, "config", None) else None
    overrides = parse_assignments(getattr(args, "config_set", []) or [], "--set")
    overrides.update({k: v for k, v in (flags or {}).items() if v is not None})
    return settings, overrides


def backend_name(args: argparse.Namespace, settings: Any) -> str:
    """``--backend``, else the config file's ``rollout.name``."""
    name = getattr(args, "backend", None) or (settings.backend if settings is not None else None)
    if not name:
        raise InvalidRequest("backend", "give --backend NAME (or rollout.name in the --config file)")
    return str(name)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``rlinfer`` command (built-ins plus ``rlinfer.commands``)."""
    parser = argparse.ArgumentParser(prog="rlinfer", description="One contract for RL rollout engines.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends, engine versions, capabilities, load errors")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_backends)
    failures = load_commands(sub)
    parser.set_defaults(command_load_errors=failures)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlinfer`` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    broken = {f.name: f for f in parser.get_default("command_load_errors")}
    if argv and argv[0] in broken:
        f = broken[argv[0]]
        print(f"rlinfer: error: command {f.name!r} from {f.distribution} failed to load: {f.error}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args))
    except RLInferError as exc:
        print(f"rlinfer: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
