"""``rlinfer conformance --backend NAME --report r.json``: run the packaged suite via pytest.

Registered on the ``rlinfer`` command through the ``rlinfer.commands`` entry point
(:func:`register`), so the core never imports the kit.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

SUITE = "rlinfer_conformance.suite"


def pytest_args(backend: str, report: str | None, profile: str = "ci", extra: list[str] | None = None) -> list[str]:
    """The pytest command line that runs the packaged suite against ``backend``."""
    args = ["--pyargs", SUITE, "-q", "-p", "no:cacheprovider", "--rlinfer-backend", backend]
    args += ["--rlinfer-profile", profile]
    if report:
        args += ["--rlinfer-report", report]
    return args + list(extra or [])


def config_file_args(fields: dict[str, Any]) -> list[str]:
    """``--rlinfer-config FIELD=JSON`` items for EngineConfig fields from a config file.

    ``model`` is refused: the kit serves its own tiny models (the oracle must know the weights).
    """
    from rlinfer_core.errors import InvalidRequest

    if "model" in fields:
        raise InvalidRequest("model", "rlinfer conformance serves the kit's own tiny models; drop rollout.model")
    out: list[str] = []
    for key, value in fields.items():
        out += ["--rlinfer-config", f"{key}={json.dumps(value)}"]
    return out


def main(args: argparse.Namespace | Any) -> int:
    """Run the kit; returns pytest's exit code (0 when every test passed or was skipped).

    With ``--config FILE``, the file's ``rollout:`` fields go first and the pytest arguments
    after ``--`` (e.g. ``--rlinfer-config``) override them.
    """
    import pytest

    backend = getattr(args, "backend", None)
    file_args: list[str] = []
    if getattr(args, "config", None):
        from rlinfer_core.config_file import read_config_file
        from rlinfer_core.errors import InvalidRequest

        settings = read_config_file(args.config)
        backend = backend or settings.backend
        file_args = config_file_args(dict(settings.fields))
        if not backend:
            raise InvalidRequest("backend", "give --backend NAME (or rollout.name in the --config file)")
    if not backend:
        from rlinfer_core.errors import InvalidRequest

        raise InvalidRequest("backend", "give --backend NAME")
    code = pytest.main(
        pytest_args(
            backend,
            getattr(args, "report", None),
            getattr(args, "profile", "ci") or "ci",
            file_args
            + (["--rlinfer-replicas", str(args.replicas)] if getattr(args, "replicas", None) else [])
            + list(getattr(args, "pytest_args", []) or []),
        )
    )
    if getattr(args, "report", None):
        print(f"rlinfer conformance report: {args.report}")
    return int(code)


def register(subparsers: Any) -> None:
    """Add ``conformance`` to the ``rlinfer`` command (``rlinfer.commands`` entry point)."""
    p = subparsers.add_parser("conformance", help="run the conformance kit against a backend")
    p.add_argument("--backend", help="backend name (or rollout.name in --config)")
    p.add_argument("--report", help="write the JSON report here")
    p.add_argument("--profile", default="ci", choices=["ci", "thorough"], help="hypothesis profile")
    p.add_argument("--replicas", type=int, help="run the kit against an rlinfer-ray pool of N replicas")
    p.add_argument("--config", metavar="FILE", help="YAML/TOML with a rollout: section (engine settings for the kit)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    p.set_defaults(func=main)
