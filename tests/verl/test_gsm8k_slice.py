"""The worked example's CPU slice (examples/verl/gsm8k_cpu_slice.py): verl's GSM8K GRPO recipe
with rollout.name=rlinfer, through verl's agent loop, reward, GRPO advantage and weight sync.

Runs with ``RLINFER_VERL_SLICE_TESTS=1`` (``make test-verl-example``, in ``make thorough``; ~1.5 min
on 2 cores: its own engine and Ray cluster)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("RLINFER_VERL_SLICE_TESTS") != "1",
    reason="the verl GSM8K CPU slice runs in `make test-verl-example` (RLINFER_VERL_SLICE_TESTS=1)",
)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl" / "gsm8k_cpu_slice.py"


def test_gsm8k_grpo_slice_runs_on_rlinfer(tmp_path: Path) -> None:
    import ray

    spec = importlib.util.spec_from_file_location("gsm8k_cpu_slice", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = asyncio.run(example.run("vllm", tmp_path))
    finally:
        ray.shutdown()
    groups, n = len(example.QUESTIONS), 4
    assert summary["responses_shape"] == [groups * n, 16]  # padded to data.max_response_length
    assert summary["rollout_log_probs"] is True
    assert len(summary["grpo"]["scores"]) == groups * n and set(summary["grpo"]["scores"]) <= {0.0, 1.0}
    assert summary["grpo"]["advantages_finite"] is True
    # the synced weights serve: version 1 and different responses
    assert summary["weight_version"] == 1 and summary["responses_changed"] is True
