"""An engine driven from the main thread (asyncio.run): the caller's signal handling survives
SGLang's, and a killed scheduler gives EngineDead instead of killing the caller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")


def test_main_thread_engine_leaves_the_caller_in_charge(tmp_path: Path) -> None:
    probe = Path(__file__).with_name("main_thread_probe.py")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(
        [sys.executable, str(probe), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sigterm_kept"], "the caller's SIGTERM handler is restored after SGLang's start"
    assert result["engine_dead"], "an in-flight generate raises EngineDead"
    assert result["seconds"] < 5.0
    assert result["survived"], "the caller process is not killed by SGLang's crash handling"
