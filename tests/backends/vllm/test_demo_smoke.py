"""`rlinfer demo --backend vllm` end to end: a short real GRPO run through the real vLLM engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rlinfer_vllm.plugin")
pytest.importorskip("rlinfer_demo.commands")  # rlinfer-demo registers the demo command
pytest.importorskip("vllm")

PNG = b"\x89PNG\r\n\x1a\n"


def _rlinfer(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(
        [sys.executable, "-m", "rlinfer_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_demo_two_steps_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = _rlinfer("demo", "--backend", "vllm", "--steps", "2", "--out", str(out), timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())

    steps = report["steps"]
    assert [s["step"] for s in steps] == [0, 1]
    # step k samples with the weights synced after step k-1: versions 0, 1
    assert [s["weight_version"] for s in steps] == [0, 1]
    for s in steps:
        assert 0.0 <= s["reward_min"] <= s["reward_mean"] <= s["reward_max"] <= 1.0
        assert 0.0 <= s["logprob_gap_max"] <= 1e-5
        assert s["sync_s"] > 0.0 and s["tokens"] > 0
    engine = report["engine"]
    assert engine["backend"] == "vllm"
    if engine["platform"] == "cpu":
        assert engine["memory_release"].startswith("not supported on cpu (skipped)")
    summary = report["summary"]
    assert summary["parity_ok_every_step"] is True
    assert summary["max_logprob_gap"] <= summary["parity_tolerance"] == 1e-5
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == PNG
    assert "parity" in proc.stdout and "reward" in proc.stdout


def test_demo_rejects_missing_model_dir(tmp_path: Path) -> None:
    proc = _rlinfer("demo", "--backend", "vllm", "--model", str(tmp_path / "nope"), timeout=120)
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr
