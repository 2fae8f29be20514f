"""Track the processes an engine start creates, so that shutdown can prove none is left."""

from __future__ import annotations

import contextlib
import os
from typing import Any

#: Python's own helper processes: they belong to the interpreter, not to the engine, serve every
#: later user of shared memory in this process, and exit with it
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _children() -> list[Any]:
    import psutil  # type: ignore[import-untyped]

    return list(psutil.Process(os.getpid()).children(recursive=True))


def _is_helper(proc: Any) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
    except Exception:  # gone already, or not ours to read
        return False
    return any(name in cmdline for name in INTERPRETER_HELPERS)


def snapshot() -> set[int]:
    """Pids of this process's descendants now."""
    return {p.pid for p in _children()}


def started_since(before: set[int]) -> list[Any]:
    """psutil.Process objects of descendants created since ``before`` (interpreter helpers excluded)."""
    return [p for p in _children() if p.pid not in before and not _is_helper(p)]


def alive(procs: list[Any]) -> list[Any]:
    """Those of ``procs`` still running (psutil checks pid and start time, so reuse is safe)."""
    return [p for p in procs if p.is_running() and p.status() != "zombie"]


def reap(procs: list[Any], timeout_s: float = 10.0) -> list[int]:
    """Wait for ``procs`` to exit; kill the ones still alive after ``timeout_s``; return their pids."""
    import psutil  # type: ignore[import-untyped]

    _, still = psutil.wait_procs(alive(procs), timeout=timeout_s)
    for proc in still:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(still, timeout=5.0)
    return [p.pid for p in still]
