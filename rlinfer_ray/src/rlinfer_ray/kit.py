"""The conformance kit against a pool: ``--rlinfer-replicas N`` opens one of these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlinfer_core.engine import Engine
from rlinfer_core.types import EngineConfig
from rlinfer_ray.config import PoolConfig
from rlinfer_ray.pool import open_pool


def open_kit_engine(backend: str, config: EngineConfig, replicas: int, plugins: Sequence[Any] = ()) -> Engine:
    """A pool of ``replicas`` engines with the kit's config, as the kit's session engine."""
    return open_pool(backend, config, pool=PoolConfig(replicas=replicas), plugins=plugins)
