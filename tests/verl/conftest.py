"""The verl plugin's tests: run in the verl environment (`make test-verl`, .venvs/verl)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the rlinfer-verl tests run in the verl environment: make test-verl")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The kit's two tiny models (seed 0 served at start, seed 1 for the update)."""
    from rlinfer_conformance.world import BASE, OTHER, make_models

    base, other = make_models(tmp_path_factory.mktemp("verl-models"), "llama")
    return {BASE: base, OTHER: other}
