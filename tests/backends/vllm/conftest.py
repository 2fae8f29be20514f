"""One vLLM engine on a tiny Qwen2 (q/k/v biases, head tied to the embedding) for the test modules
of vLLM-specific behaviour (test_vllm_engine.py, test_vllm_tied.py, test_fast_load.py): an engine
start is ~50 s on 2 cores. Each test leaves seed 0's weights served; a test marked
``ends_shared_engine`` shuts it down, so it runs after every other test of that engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ends_shared_engine: shuts the shared engine down; runs last")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``ends_shared_engine`` right after the last other test of the shared engine."""
    ending = [item for item in items if item.get_closest_marker("ends_shared_engine")]
    rest = [item for item in items if not item.get_closest_marker("ends_shared_engine")]
    users = [n for n, item in enumerate(rest) if "qwen2_engine" in getattr(item, "fixturenames", ())]
    at = users[-1] + 1 if users else len(rest)
    items[:] = rest[:at] + ending + rest[at:]


@pytest.fixture(scope="session")
def qwen2_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Tiny Qwen2 checkpoints of seeds 0 (served at start) and 1."""
    from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("vllm-qwen2")
    spec = TinyModelSpec(architecture="qwen2")
    return make_tiny_model(root / "seed0", seed=0, spec=spec), make_tiny_model(root / "seed1", seed=1, spec=spec)


@pytest.fixture(scope="session")
def qwen2_engine(qwen2_models: tuple[Path, Path]) -> Iterator[Any]:
    """The vLLM engine serving seed 0 of :func:`qwen2_models`."""
    pytest.importorskip("vllm")
    from vllm_test_helpers import ENGINE_FIELDS

    from rlinfer_core.engine import open_engine

    engine = open_engine("vllm", model=str(qwen2_models[0]), load_entry_point_plugins=False, **ENGINE_FIELDS)
    try:
        yield engine
    finally:
        engine.shutdown()
