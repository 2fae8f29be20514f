"""SGLang's signal handling must never take the caller down (each case in a fresh interpreter):
an engine on the main thread keeps the caller's SIGTERM handler and turns a killed scheduler into
EngineDead; the sync Engine (loop off the main thread) survives a scheduler that fails at launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")


def _probe(name: str, tmp_path: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(name)), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_main_thread_engine_leaves_the_caller_in_charge(tmp_path: Path) -> None:
    result = _probe("main_thread_probe.py", tmp_path)
    assert result["sigterm_kept"], "the caller's SIGTERM handler is restored after SGLang's start"
    assert result["engine_dead"], "an in-flight generate raises EngineDead"
    assert result["seconds"] < 5.0
    assert result["survived"], "the caller process is not killed by SGLang's crash handling"


def test_scheduler_failing_at_launch_gives_backend_load_error(tmp_path: Path) -> None:
    result = _probe("broken_model_probe.py", tmp_path)
    assert result["error"] == "BackendLoadError", "the caller survives SGLang's SIGQUIT and gets a typed error"
    assert result["children"] == [], "no engine process is left behind"
