"""``rlinfer conformance --backend NAME --report r.json``: run the packaged suite via pytest."""

from __future__ import annotations

import argparse
from typing import Any

SUITE = "rlinfer_conformance.suite"


def pytest_args(backend: str, report: str | None, profile: str = "ci", extra: list[str] | None = None) -> list[str]:
    """The pytest command line that runs the packaged suite against ``backend``."""
    args = ["--pyargs", SUITE, "-q", "-p", "no:cacheprovider", "--rlinfer-backend", backend]
    args += ["--rlinfer-profile", profile]
    if report:
        args += ["--rlinfer-report", report]
    return args + list(extra or [])


def main(args: argparse.Namespace | Any) -> int:
    """Run the kit; returns pytest's exit code (0 when every test passed or was skipped)."""
    import pytest

    code = pytest.main(
        pytest_args(
            args.backend,
            getattr(args, "report", None),
            getattr(args, "profile", "ci") or "ci",
            list(getattr(args, "pytest_args", []) or []),
        )
    )
    if getattr(args, "report", None):
        print(f"rlinfer conformance report: {args.report}")
    return int(code)
