"""IPC (shared memory) and broadcast (gloo) transports, across real spawned processes."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from mp_workers import broadcast_child, ipc_child, sender_child, silent_rank_child

from rlinfer_core.errors import EngineTimeout, WeightUpdateError
from rlinfer_core.transfer.broadcast import WeightBroadcaster, create_group, destroy_group, free_port, receive
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
    proc, results = _run_child(silent_rank_child, group, 1)
    sender = WeightBroadcaster(group)  # blocks until the child joined
    try:
        assert results.get(timeout=CHILD_TIMEOUT_S) == ("ok", "joined")
        started = time.monotonic()
        with pytest.raises(EngineTimeout, match=r"did not take the trainer's broadcast.*0 of 1 broadcasts completed"):
            sender.send([("big", torch.zeros(64 << 20, dtype=torch.uint8))])
        assert time.monotonic() - started < 30
        with pytest.raises(WeightUpdateError, match="broken"):  # a timed-out group is not used again
            sender.send([("small", torch.zeros(4))])
        closing = time.monotonic()
        sender.close()  # aborts the broken group without waiting on the silent rank
        assert time.monotonic() - closing < 15
    finally:
        proc.kill()


def test_receive_from_a_trainer_that_never_sends_times_out_and_the_rank_joins_again() -> None:
    """The engine side has the group's deadline too (typed, saying how far it got), and the
    receiving process can join a new group afterwards and receive from it."""
    tensors = _tensors()
    specs = WeightBroadcaster.source(tensors).specs
    group = BroadcastGroup("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=3.0)
    proc, results = _run_child(silent_rank_child, group, 0)
    pg = create_group(group, rank=1)  # blocks until the child (rank 0, the store's host) joined
    try:
        assert results.get(timeout=CHILD_TIMEOUT_S) == ("ok", "joined")
        started = time.monotonic()
        with pytest.raises(EngineTimeout, match=r"the trainer's broadcast did not arrive.*broadcasts completed"):
            receive(pg, specs)
        assert time.monotonic() - started < 30
        destroy_group(pg)
    finally:
        proc.kill()

    again = BroadcastGroup("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60.0)
    proc, results = _run_child(sender_child, again, tensors)
    pg = create_group(again, rank=1)
    try:
        received = receive(pg, specs)
        assert _result(proc, results) == "sent"
    finally:
        destroy_group(pg)
    assert _expected(received) == _expected(tensors)


class _Group:
    """A stand-in for a torch process group (a key of the module's weak maps); test double."""


def test_a_broadcast_call_that_never_returns_is_bounded_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch creates an NCCL communicator inside the first collective call, which blocks without
    a timeout until every rank made it: that call stands in here as one that never returns. The
    caller still gets its EngineTimeout at the deadline, saying where it stood, and the group is
    refused afterwards."""
    import torch.distributed as dist

    from rlinfer_core.transfer import broadcast

    never = threading.Event()
    monkeypatch.setattr(dist, "broadcast", lambda *args, **kwargs: never.wait())
    monkeypatch.setattr(broadcast, "_REPORT_GRACE_S", 0.2)
    pg = _Group()
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match="still inside the first broadcast call"):
        broadcast.broadcast_by(pg, [torch.zeros(2)], time.monotonic() + 1.0, "the trainer's broadcast did not arrive")
    assert 1.0 <= time.monotonic() - started < 10
    with pytest.raises(WeightUpdateError, match="broken"):
        broadcast.broadcast_by(pg, [torch.zeros(2)], time.monotonic() + 1.0, "again")
    never.set()  # let the helper thread end
