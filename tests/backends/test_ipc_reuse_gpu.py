"""CUDA tensors of the trainer reach the engine (vLLM's worker, SGLang's scheduler) through
buffers mapped once: with RLINFER_REUSE_IPC_BUFFERS=1 the second and later updates of one layout
reuse the buffers the engine mapped for the first (rlinfer_core.transfer.arena), and the engine
serves each update's weights. Needs a CUDA GPU; run in each engine's environment (the other
engine's case skips there)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU")

#: per backend: the engine's open arguments besides the model (SGLang: triton attention, the GPU
#: bundle of docs/gpu.md leaves its FA3 kernels out; bfloat16, its CUDA RMSNorm has no float32)
OPEN_ARGS: dict[str, dict[str, Any]] = {
    "vllm": {"dtype": "float32", "gpu_memory_utilization": 0.3},
    "sglang": {"dtype": "bfloat16", "engine_kwargs": {"attention_backend": "triton"}},
}


class EngineTimings(logging.Handler):
    """The dicts of engine-side timings the backend logs at debug level with every update (a
    handler of our own: an engine may reconfigure the root logger that pytest's capture uses)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.rows: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the record's dict arguments."""
        args = record.args if isinstance(record.args, tuple) else ()
        self.rows.extend(a for a in args if isinstance(a, dict))

    def reused_per_update(self) -> list[Any]:
        """``ipc_reused`` of each update's line."""
        return [row["ipc_reused"] for row in self.rows if "ipc_reused" in row]


@pytest.mark.parametrize("backend", sorted(OPEN_ARGS))
def test_later_cuda_updates_map_no_new_buffer(backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed in this environment")
    from rlinfer_core.engine import Engine
    from rlinfer_core.tiny_model import make_tiny_model
    from rlinfer_core.transfer.arena import REUSE_ENV
    from rlinfer_core.transfer.disk import read_tensors
    from rlinfer_core.types import Capability, GenerateRequest, SamplingParams
    from rlinfer_core.weights import NamedTensors

    monkeypatch.setenv(REUSE_ENV, "1")  # reuse is opt-in
    model = make_tiny_model(tmp_path / "model", seed=0)
    dtype = getattr(torch, OPEN_ARGS[backend]["dtype"])
    base = [(name, t.to("cuda", dtype=dtype)) for name, t in read_tensors(model)]
    timings, logger = EngineTimings(), logging.getLogger(f"rlinfer_{backend}")
    engine = Engine.open(backend, model=str(model), device="cuda", **OPEN_ARGS[backend])
    logger.addHandler(timings)
    level, logger.level = logger.level, logging.DEBUG
    try:
        checksums = engine.capabilities.supports(Capability.WEIGHTS_CHECKSUM)
        served: list[tuple[float, ...]] = []
        for step in range(3):
            update = [(name, t + 0.05 * step) for name, t in base]
            engine.update_weights(NamedTensors.of(update))
            if checksums:
                assert engine.verify_weights(update).ok
            else:  # SGLang on CUDA claims no checksums: each update must change what is served
                request = GenerateRequest(
                    prompt_token_ids=(1, 2, 3, 4), sampling=SamplingParams(max_tokens=4, temperature=0)
                )
                served.append(engine.generate([request])[0].logprobs)
        assert len(set(served)) == len(served), served
        reused = timings.reused_per_update()
        assert len(reused) == 3, reused
        assert reused[0] == 0  # the first update of a layout maps its buffers
        assert reused[1] == reused[2] > 0, reused  # later ones map nothing new
    finally:
        logger.removeHandler(timings)
        logger.setLevel(level)
        engine.shutdown()
