"""One real pool (two engine replicas on a local Ray cluster) shared by the pool tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: backend of the replicas; the conformance kit covers both backends through --rlinfer-replicas
BACKEND = os.environ.get("RLINFER_RAY_BACKEND", "vllm")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rlinfer_core.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("ray-models")
    return {"base": make_tiny_model(tmp / "seed0", seed=0), "other": make_tiny_model(tmp / "seed1", seed=1)}


@pytest.fixture(scope="session")
def pool(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Iterator[Any]:
    """A pool of two replicas of seed 0. When the conformance kit runs in the same session against
    a pool of two of the same backend (`make test-ray`), it is the kit's pool: its model and config
    are these (the same seeds, ``default_config``), and a 2-replica start is ~2 min on 2 cores."""
    from rlinfer_conformance.world import default_config
    from rlinfer_ray import PoolConfig, open_pool

    config = request.config
    if config.getoption("--rlinfer-backend", None) == BACKEND and config.getoption("--rlinfer-replicas") == 2:
        yield request.getfixturevalue("rlinfer_world").engine
        return
    engine = open_pool(BACKEND, default_config(model_dirs["base"], {}), pool=PoolConfig(replicas=2))
    try:
        yield engine
    finally:
        engine.shutdown()
