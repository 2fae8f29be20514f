"""Track the processes an engine start creates, so that shutdown stops exactly those.

Backends snapshot this process's descendants before starting their engine and keep what
appeared since. At shutdown they reap (wait, then kill) or kill (terminate, then kill) only
those: engines such as SGLang otherwise kill *every* child of the caller, and a trainer's
data-loader workers must survive an engine shutdown. Needs psutil (``rlinfer-core[backend]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Python's own helper processes: they belong to the interpreter, not to the engine, serve every
#: later user of shared memory in this process, and exit with it
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _children() -> list[Any]:
    import psutil

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
    out = []
    for proc in procs:
        with contextlib.suppress(Exception):  # a process may vanish between the two checks
            if proc.is_running() and proc.status() != "zombie":
                out.append(proc)
    return out


def _kill_survivors(running: list[Any], timeout_s: float) -> list[int]:
    import psutil

    _, still = psutil.wait_procs(running, timeout=timeout_s)
    for proc in still:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(still, timeout=5.0)
    return [p.pid for p in still]


def reap(procs: list[Any], timeout_s: float = 10.0) -> list[int]:
    """Wait for ``procs`` to exit; kill the ones still alive after ``timeout_s``; return their pids."""
    return _kill_survivors(alive(procs), timeout_s)


def kill(procs: list[Any], grace_s: float = 5.0) -> list[int]:
    """SIGTERM ``procs`` (and their descendants), SIGKILL what is left after ``grace_s``; reap.

    Returns the pids that had to be killed with SIGKILL.
    """
    import psutil

    everyone = list(procs)
    for proc in procs:
        with contextlib.suppress(Exception):
            everyone.extend(proc.children(recursive=True))
    running = alive(everyone)
    for proc in running:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    killed = _kill_survivors(running, grace_s)
    for proc in everyone:  # reap children that died on their own (e.g. a killed scheduler)
        with contextlib.suppress(Exception):
            if proc.status() == psutil.STATUS_ZOMBIE:
                proc.wait(timeout=1.0)
    return killed


async def start_in_thread(start: Callable[[], T], if_abandoned: Callable[[asyncio.Future[T]], None]) -> T:
    """Run a blocking engine start in a worker thread; return what it returns.

    The event loop (and the facade's startup timeout) keeps running meanwhile. A thread cannot be
    interrupted: when the awaiting task is cancelled (the startup timeout), the start goes on, and
    ``if_abandoned`` gets its future once it is done, to shut down whatever it started.
    """
    future = asyncio.get_running_loop().run_in_executor(None, start)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(if_abandoned)
        raise
