"""`rlinfer demo --task agent` end to end on vLLM: sessions with the calc tool, two GRPO steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("rlinfer_vllm.plugin")
pytest.importorskip("rlinfer_demo.commands")
pytest.importorskip("vllm")

from test_demo_smoke import PNG, _rlinfer


def test_agent_demo_two_steps(tmp_path: Path) -> None:
    out = tmp_path / "agent"
    proc = _rlinfer("demo", "--task", "agent", "--backend", "vllm", "--steps", "2", "--out", str(out), timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "agent_report.json").read_text())
    assert report["engine"]["logprobs_mode"] == "raw"  # vLLM claims logprobs.raw: parity is checked
    steps = report["steps"]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert 0.0 <= s["reward_mean"] <= 1.0
        assert s["exact"] == 1.0, "every episode follows the chat template exactly"
        assert s["model_tokens"] > 0 and s["logprob_gap_max"] <= 1e-5
    assert report["summary"]["parity_ok_every_step"] is True
    assert (out / "agent_reward.png").read_bytes()[:8] == PNG
