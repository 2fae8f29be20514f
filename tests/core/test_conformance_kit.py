"""Run the conformance kit against the HF test double (no real engine) and check its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOUBLES = Path(__file__).parent / "doubles"


def _register_double(tmp: Path) -> Path:
    """A dist-info with a real ``rlinfer.backends`` entry point for the double (test-only)."""
    site = tmp / "site"
    info = site / "rlinfer_hf_double-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlinfer-hf-double\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[rlinfer.backends]\nhfdouble = hf_double:backend\n")
    return site


@pytest.fixture(scope="module")
def kit_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, str]:
    tmp = tmp_path_factory.mktemp("kit")
    site = _register_double(tmp)
    report = tmp / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(DOUBLES)]), RLINFER_BACKENDS="hfdouble")
    proc = subprocess.run(
        [sys.executable, "-m", "rlinfer_core.cli", "conformance", "--backend", "hfdouble", "--report", str(report)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return proc.returncode, json.loads(report.read_text()), proc.stdout[-6000:] + proc.stderr[-3000:]


def test_kit_passes_on_the_double(kit_report: tuple[int, dict, str]) -> None:
    code, report, output = kit_report
    failed = {k: v for k, v in report["tests"].items() if v["outcome"] == "failed"}
    assert code == 0 and not failed, output
    assert report["summary"]["passed"] >= 40


def test_report_content(kit_report: tuple[int, dict, str]) -> None:
    _, report, _ = kit_report
    assert report["backend"] == "hfdouble"
    assert report["engine_version"]
    assert report["capabilities"]["platform"] == "cpu"
    checkpoints = {p["checkpoint"] for p in report["parity"]}
    assert {"start", "start_sampled"} <= checkpoints
    assert any(c.startswith("after_update_tensors") for c in checkpoints)
    assert report["max_abs_logprob_delta"] <= 1e-5
    skipped = {c for caps in report["skipped_capabilities"].values() for c in caps}
    assert {"abort", "memory.release", "weights.broadcast"} <= skipped
    negative = [k for k in report["tests"] if "test_unsupported_capability_raises[abort]" in k]
    assert negative and report["tests"][negative[0]]["outcome"] == "passed"


def test_argmax_tie_band_widens_with_the_logprob_tolerance() -> None:
    from rlinfer_conformance.oracle import TIE_TOLERANCE, tie_band

    assert tie_band(1e-5) == TIE_TOLERANCE  # the CPU default keeps the fixed band
    assert tie_band(1e-3) == pytest.approx(2e-3)  # GPU kernels: logits may swap within 2 * tol


def test_one_run_checks_each_configuration(tmp_path: Path) -> None:
    """Two ``--rlinfer-configuration`` in one session: every engine test runs under each, the
    first configuration's tests (its last test included) before the second's, and the report
    records each configuration's fields (``replicas`` is the kit's, not an EngineConfig field)."""
    site = _register_double(tmp_path)
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(DOUBLES)]), RLINFER_BACKENDS="hfdouble")
    selected = "test_greedy_matches_oracle_at_start or test_shutdown_is_final_and_idempotent"
    command = [sys.executable, "-m", "rlinfer_core.cli", "conformance", "--backend", "hfdouble"]
    command += ["--report", str(report), "--", "-k", selected]
    for configuration in ("max_num_seqs=8,replicas=1", "max_num_seqs=4,seed=3"):
        command += ["--rlinfer-configuration", configuration]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    written = json.loads(report.read_text())
    ran = [nodeid.split("::")[-1] for nodeid, entry in written["tests"].items() if entry["outcome"] == "passed"]
    assert ran == [  # in the order they ran
        "test_greedy_matches_oracle_at_start[max_num_seqs-8+replicas-1]",
        "test_shutdown_is_final_and_idempotent[max_num_seqs-8+replicas-1]",
        "test_greedy_matches_oracle_at_start[max_num_seqs-4+seed-3]",
        "test_shutdown_is_final_and_idempotent[max_num_seqs-4+seed-3]",
    ], written["tests"]
    fields = [c["fields"] for c in written["configurations"]]
    assert fields == [{"max_num_seqs": 8, "replicas": 1}, {"max_num_seqs": 4, "seed": 3}]
