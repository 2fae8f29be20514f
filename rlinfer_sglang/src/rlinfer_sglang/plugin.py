"""Entry point ``rlinfer.backends: sglang``: a cheap :class:`BackendInfo`; imports no engine."""

from __future__ import annotations

from typing import Any

from rlinfer_core.discovery import BackendInfo
from rlinfer_core.types import EngineConfig
from rlinfer_sglang.capabilities import BACKEND, ENGINE_REQUIREMENTS, describe


def create(config: EngineConfig) -> Any:
    """The backend for ``config``: SGLang's offline Engine in this process, or with
    ``mode="server"`` / ``server_url`` SGLang's HTTP server (:mod:`rlinfer_sglang.server_mode`)."""
    if config.server_mode:
        from rlinfer_sglang.server_mode.backend import SGLangServerBackend

        return SGLangServerBackend(config)
    from rlinfer_sglang.backend import create as inprocess

    return inprocess(config)


backend = BackendInfo(
    name=BACKEND,
    engine_requirements=ENGINE_REQUIREMENTS,  # type: ignore[arg-type]  # attrs converter=tuple confuses mypy
    factory="rlinfer_sglang.plugin:create",
    describe=describe,
    summary="SGLang offline Engine or HTTP server (0.5.23 on CPU with native PyTorch kernels, 0.5.16+ on CUDA)",
)
