"""Child-process bodies for the IPC and broadcast tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any


def ipc_child(payload: bytes, results: Any) -> None:
    """Map tensors shared by the parent, report their values, then write into each one."""
    from rlinfer_core.transfer.ipc import loads

    try:
        tensors = loads(payload)
        report = [(name, str(t.dtype), tuple(t.shape), t.float().reshape(-1).tolist()) for name, t in tensors]
        for _, t in tensors:
            if t.numel():
                t.view(-1)[0] = 7
        results.put(("ok", report))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def broadcast_child(group: Any, specs: Any, results: Any) -> None:
    """Join the weight group as rank 1 and receive the tensors described by ``specs``."""
    from rlinfer_core.transfer.broadcast import create_group, destroy_group, receive

    try:
        pg = create_group(group, rank=1)
        got = receive(pg, specs)
        results.put(("ok", [(n, str(t.dtype), tuple(t.shape), t.float().reshape(-1).tolist()) for n, t in got]))
        destroy_group(pg)
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def silent_rank_child(group: Any, results: Any) -> None:
    """Join the weight group as rank 1, then never take part in a broadcast (an engine rank
    that hangs)."""
    import time

    from rlinfer_core.transfer.broadcast import create_group

    try:
        create_group(group, rank=1)
        results.put(("ok", "joined"))
        time.sleep(60)
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
