"""IPC (shared memory) and broadcast (gloo) transports, across real spawned processes."""

from __future__ import annotations

import queue
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from mp_workers import broadcast_child, ipc_child, silent_rank_child

from rlinfer_core.errors import EngineTimeout
from rlinfer_core.transfer.broadcast import WeightBroadcaster, free_port
from rlinfer_core.transfer.ipc import dumps
from rlinfer_core.weights import BroadcastGroup

CHILD_TIMEOUT_S = 120


def _tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a.float32", torch.randn(3, 4, generator=gen)),
        ("b.bfloat16", torch.randn(5, generator=gen).to(torch.bfloat16)),
        ("c.int64", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("d.scalar", torch.tensor(1.5)),
        ("e.empty", torch.empty(0, 2)),
    ]


def _run_child(target: Any, *args: Any) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, results), daemon=True)
    proc.start()
    return [proc, results]


def _result(proc: Any, results: Any) -> Any:
    try:
        status, value = results.get(timeout=CHILD_TIMEOUT_S)
    except queue.Empty:
        proc.kill()
        pytest.fail("child process did not answer in time")
    proc.join(timeout=30)
    assert status == "ok", value
    return value


def _expected(tensors: list[tuple[str, torch.Tensor]]) -> list[Any]:
    return [(n, str(t.dtype), tuple(t.shape), t.float().reshape(-1).tolist()) for n, t in tensors]


def test_ipc_child_sees_same_values_and_its_writes_are_shared() -> None:
    tensors = _tensors()
    expected = _expected(tensors)
    payload = dumps(tensors)
    assert isinstance(payload, bytes)
    proc, results = _run_child(ipc_child, payload)
    report = _result(proc, results)
    assert report == expected
    # the child wrote 7 into element 0 of every non-empty tensor: the memory is really shared
    for name, t in tensors:
        if t.numel():
            assert t.reshape(-1)[0].item() == 7, name
            assert t.is_shared(), name


def test_broadcast_rank0_to_spawned_rank1_over_gloo() -> None:
    tensors = _tensors()
    group = BroadcastGroup("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60.0)
    source = WeightBroadcaster.source(tensors)
    proc, results = _run_child(broadcast_child, group, source.specs)
    sender = WeightBroadcaster(group)  # blocks until the child joined
    try:
        sender.send(tensors)
        received = _result(proc, results)
    finally:
        sender.close()
    assert received == _expected(tensors)


def test_broadcast_to_a_rank_that_never_receives_times_out() -> None:
    group = BroadcastGroup("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=3.0)
    proc, results = _run_child(silent_rank_child, group)
    sender = WeightBroadcaster(group)  # blocks until the child joined
    try:
        assert results.get(timeout=CHILD_TIMEOUT_S) == ("ok", "joined")
        started = time.monotonic()
        with pytest.raises(EngineTimeout, match="did not take the trainer's broadcast"):
            sender.send([("big", torch.zeros(64 << 20, dtype=torch.uint8))])
        assert time.monotonic() - started < 30
    finally:
        proc.kill()
