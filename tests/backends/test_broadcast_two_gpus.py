"""NCCL weight broadcast between two processes on two GPUs, without an engine: the trainer on
GPU 1, a receiving rank on GPU 0 set up the ways the engines set up theirs. It separates the
causes of the 2-GPU hang of session 13 (vLLM's rank never took the trainer's broadcast, SGLang's
did): if every case here passes, the cause is inside vLLM's worker, not NCCL between the GPUs.
Needs 2 CUDA GPUs; run with NCCL_DEBUG=INFO to see NCCL's transport choice (P2P, SHM)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from mp_workers import gpu_receiver_child

from rlinfer_core.errors import EngineTimeout
from rlinfer_core.transfer.broadcast import WeightBroadcaster, free_port
from rlinfer_core.weights import BroadcastGroup

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

#: each side's deadline (the group's timeout_s); a failing case ends within it
TIMEOUT_S = 60.0
#: how long the trainer's close may take while the receiving rank still holds the group
CLOSE_LIMIT_S = 20.0


@pytest.mark.parametrize(
    ("visible", "default_group", "receiver_stays"),
    [
        pytest.param("", False, False, id="receiver-sees-all-gpus"),  # SGLang's scheduler
        pytest.param("0", False, False, id="receiver-sees-gpu0-only"),  # an engine process limited to its GPUs
        pytest.param("", True, False, id="receiver-has-a-default-nccl-group"),  # vLLM's worker at TP=1
        # vLLM's worker keeps its side until it joins the next group: the trainer's close must not wait
        pytest.param("", True, True, id="receiver-keeps-its-side-open"),
    ],
)
def test_trainer_on_gpu1_broadcasts_into_a_rank_on_gpu0(
    visible: str, default_group: bool, receiver_stays: bool
) -> None:
    tensors = [(f"t{i}", torch.full((1024, 256), float(i + 1), device="cuda:1")) for i in range(4)]
    group = BroadcastGroup("127.0.0.1", free_port(), world_size=2, backend="nccl", timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    leave = ctx.Event()
    child = ctx.Process(
        target=gpu_receiver_child,
        args=(group, WeightBroadcaster.source(tensors).specs, visible, default_group, results),
        kwargs={"leave": leave if receiver_stays else None},
        daemon=True,
    )
    child.start()
    torch.cuda.set_device(1)
    sender = WeightBroadcaster(group)
    trainer = "sent"
    try:
        try:
            sender.send(tensors)
        except EngineTimeout as exc:  # it says how far the broadcast got
            trainer = f"EngineTimeout: {exc}"
        try:
            status, value = results.get(timeout=TIMEOUT_S + 15)
        except queue.Empty:
            status, value = "error", "no answer"
    finally:
        started = time.monotonic()
        closing = threading.Thread(target=sender.close, daemon=True)
        closing.start()
        closing.join(CLOSE_LIMIT_S)
        close_s = time.monotonic() - started
        leave.set()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert trainer == "sent" and status == "ok", f"trainer: {trainer}\nreceiving rank: {value}"
    assert value == [float(t.double().sum()) for _, t in tensors]
    assert not closing.is_alive(), f"the trainer's close still waits after {close_s:.0f} s for the receiving rank"
