"""``KEY=VALUE`` command-line assignments (re-exported by :mod:`rlinfer_core.types`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlinfer_core.errors import InvalidRequest


def parse_assignments(items: Sequence[str], what: str = "engine_kwargs") -> dict[str, Any]:
    """Parse ``["key=value", ...]`` (from a command line); values are JSON when they parse
    (``true``, ``3``, ``0.5``, ``"x"``), plain strings otherwise."""
    import json

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise InvalidRequest(what, f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out
