"""Entry point ``rlinfer.backends: sglang``: a cheap :class:`BackendInfo`; imports no engine."""

from __future__ import annotations

from rlinfer_core.discovery import BackendInfo
from rlinfer_sglang.capabilities import BACKEND, ENGINE_REQUIREMENTS, describe

backend = BackendInfo(
    name=BACKEND,
    engine_requirements=ENGINE_REQUIREMENTS,  # type: ignore[arg-type]  # attrs converter=tuple confuses mypy
    factory="rlinfer_sglang.backend:create",
    describe=describe,
    summary="SGLang offline Engine (0.5.23 on CPU with native PyTorch kernels, 0.5.16+ on CUDA)",
)
