"""The filter on vLLM's layer-wise reload logger drops its false "Failed to load weights" for
buffer-only layers (RotaryEmbedding's cos_sin_cache) and nothing else."""

from __future__ import annotations

import logging

import pytest
import torch

from rlinfer_vllm.worker.reload_log import FAILED_TO_LOAD, RELOAD_LOGGER, quiet_buffer_only_layers


class RotaryEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.zeros(4, 2), persistent=False)


class Scaled(torch.nn.Module):
    """Buffer-only here, but another instance below holds a parameter: its warnings stay."""

    def __init__(self, with_param: bool) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(2), persistent=False)
        if with_param:
            self.scale = torch.nn.Parameter(torch.ones(1))


class Stats(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(2))  # persistent: a checkpoint holds it


def test_only_buffer_only_layers_are_quiet(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Sequential(
        RotaryEmbedding(), torch.nn.Linear(2, 2), Scaled(False), Scaled(True), Stats(), RotaryEmbedding()
    )
    assert quiet_buffer_only_layers(model) == {"RotaryEmbedding"}
    assert quiet_buffer_only_layers(model) == {"RotaryEmbedding"}  # installed once, not stacked
    logger = logging.getLogger(RELOAD_LOGGER)
    assert sum(type(f).__name__ == "BufferOnlyLayersFilter" for f in logger.filters) == 1
    with caplog.at_level(logging.DEBUG, logger=RELOAD_LOGGER):
        for name in ("RotaryEmbedding", "Linear", "Scaled", "Stats"):
            logger.warning(FAILED_TO_LOAD, name)
        logger.warning("%s: Excessive loading", "RotaryEmbedding")
    assert [r.getMessage() for r in caplog.records] == [
        "Linear: Failed to load weights",
        "Scaled: Failed to load weights",
        "Stats: Failed to load weights",
        "RotaryEmbedding: Excessive loading",
    ]
