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


def silent_rank_child(group: Any, rank: int, results: Any) -> None:
    """Join the weight group as ``rank``, then never take part in a broadcast (an engine rank
    that hangs, or a trainer that never sends)."""
    import time

    from rlinfer_core.transfer.broadcast import create_group

    try:
        create_group(group, rank=rank)
        results.put(("ok", "joined"))
        time.sleep(60)
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def sender_child(group: Any, tensors: Any, results: Any) -> None:
    """The trainer (rank 0): join the weight group and broadcast ``tensors``."""
    from rlinfer_core.transfer.broadcast import WeightBroadcaster

    try:
        sender = WeightBroadcaster(group)
        sender.send(tensors)
        sender.close()
        results.put(("ok", "sent"))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def gpu_receiver_child(
    group: Any, specs: Any, visible: str, default_group: bool, results: Any, leave: Any = None
) -> None:
    """An engine rank on GPU 0 (2-GPU probe): ``visible`` limits the GPUs this process sees (set
    before CUDA starts, as vLLM would for its engine processes); ``default_group``: first set up a
    one-rank NCCL default process group, as vLLM's worker at tensor_parallel_size=1 has one;
    ``leave`` (an event): keep the group until it is set, as vLLM's worker keeps its side until
    it joins the next group. Reports the received tensors' sums, or the error (which says how far
    the broadcast got)."""
    import os

    if visible:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        import torch
        import torch.distributed as dist

        from rlinfer_core.transfer.broadcast import create_group, destroy_group, free_port, receive

        torch.cuda.set_device(0)
        if default_group:
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
        pg = create_group(group, rank=1)
        got = receive(pg, specs, device="cuda:0")
        results.put(("ok", [float(t.double().sum()) for _, t in got]))
        if leave is not None:
            leave.wait(120)
        destroy_group(pg)
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
