"""The fault matrix: every engine child process killed in turn.

For each role the backend reports (``rlinfer_engine_processes``), a fresh engine is opened, that
process is killed, and the next generate must raise EngineDead within 5 s; shutdown must leave
none of the engine's processes behind; and a new engine must open and serve afterwards.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.world import KitWorld, default_config
from rlinfer_core.errors import EngineDead, UnsupportedCapability
from rlinfer_core.types import GenerateRequest, SamplingParams

__all__ = ["test_each_engine_process_killed_in_turn"]

#: the contract's bound on noticing a dead child
DEAD_WITHIN_S = 5.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.hooks("rlinfer_engine_processes", "rlinfer_check_health")
def test_each_engine_process_killed_in_turn(
    rlinfer_world: KitWorld, rlinfer_backend: str, rlinfer_config_overrides: dict[str, Any]
) -> None:
    from rlinfer_core.engine import open_engine

    config = default_config(Path(rlinfer_world.oracle.model_dir("seed0")), rlinfer_config_overrides)
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0, max_tokens=4))
    try:
        roles = sorted(rlinfer_world.engine.engine_processes())
    except UnsupportedCapability as exc:
        pytest.skip(f"the backend does not report its engine processes: {exc}")
    if not roles:
        pytest.skip("the engine runs in this process: no child process to kill")
    for role in roles:
        engine = open_engine(rlinfer_backend, config)
        try:
            engine.generate([request])  # the engine serves before the fault
            processes = dict(engine.engine_processes())
            assert role in processes, f"{role} missing from {processes}"
            os.kill(processes[role], signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(EngineDead):
                engine.generate([GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=request.sampling)])
            took = time.monotonic() - started
            assert took <= DEAD_WITHIN_S, f"killing {role}: EngineDead after {took:.1f} s > {DEAD_WITHIN_S} s"
            with pytest.raises(EngineDead):
                engine.check_health()
        finally:
            engine.shutdown()
        left = _wait_gone(list(processes.values()), timeout_s=10.0)
        assert not left, f"after killing {role}, shutdown left processes {left}"
        rlinfer_world.report.timings[f"dead_after_kill_{role}"] = took
    with open_engine(rlinfer_backend, config) as engine:  # a new engine opens after the faults
        assert engine.generate([request])[0].token_ids
