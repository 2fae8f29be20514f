"""Entry point ``rlinfer.backends: sglang``: a cheap :class:`BackendInfo` and the factory; imports no engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinfer_core.discovery import BackendInfo
from rlinfer_core.types import EngineConfig
from rlinfer_sglang.capabilities import BACKEND, ENGINE_REQUIREMENTS, describe

if TYPE_CHECKING:
    from rlinfer_sglang.backend import SGLangBackend


def create(config: EngineConfig) -> SGLangBackend:
    """The backend for ``config``, over SGLang's offline Engine in this process, or with
    ``mode="server"`` / ``server_url`` over SGLang's HTTP server (:mod:`rlinfer_sglang.transport`)."""
    from rlinfer_sglang.backend import SGLangBackend

    if config.server_mode:
        from rlinfer_sglang.transport.http import HttpTransport

        return SGLangBackend(config, HttpTransport)
    from rlinfer_sglang.transport.in_process import InProcessTransport

    return SGLangBackend(config, InProcessTransport)


backend = BackendInfo(
    name=BACKEND,
    engine_requirements=ENGINE_REQUIREMENTS,  # type: ignore[arg-type]  # attrs converter=tuple confuses mypy
    factory="rlinfer_sglang.plugin:create",
    describe=describe,
    summary="SGLang offline Engine or HTTP server (0.5.23 on CPU with native PyTorch kernels, 0.5.16+ on CUDA)",
)
