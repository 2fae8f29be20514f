"""The HTTP dialects of ``rlinfer serve --dialect``: the routes each adds. A control route (behind
the ``--api-key`` bearer token, as ``/control/*``) is on a router tagged ``Access.CONTROL``.

Every dialect serves the OpenAI surface and rlinfer's ``/control/*`` routes too; a dialect adds
an engine server's own routes over the same engine object (an AsyncEngine, over one engine or an rlinfer-ray pool), so
rlinfer's guarantees (validation first, all-or-nothing updates, per-token versions, typed
errors, deadlines) hold whatever the trainer speaks.
"""

from __future__ import annotations

import attrs
from fastapi import APIRouter


@attrs.frozen
class Dialect:
    """One dialect: its routers (each tagged with the key its routes need, see :mod:`rlinfer_server.guard`)."""

    name: str
    routers: tuple[APIRouter, ...] = ()


def dialect_named(name: str) -> Dialect:
    """The dialect ``name`` ("openai", "sglang" or "vllm"), its router imported on demand."""
    if name == "sglang":
        from rlinfer_server import sglang_dialect

        return sglang_dialect.DIALECT
    if name == "vllm":
        from rlinfer_server import vllm_dialect

        return vllm_dialect.DIALECT
    return Dialect("openai")
