"""Fixtures shared by the dialect suites (servers are started by each suite's own fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny models of the same shapes (seed 0 served first, seed 1 for updates)."""
    from rlinfer_core.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("dialect-models")
    return make_tiny_model(root / "seed0", seed=0), make_tiny_model(root / "seed1", seed=1)
