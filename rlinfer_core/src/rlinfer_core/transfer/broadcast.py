"""A torch.distributed group between a trainer (rank 0) and an engine's workers (ranks 1..).

The group is built the way SGLang's ``init_weights_update_group``, verl and OpenRLHF build
theirs (TCP rendezvous, a store prefixed by the group name, a process group outside the default
world), so the trainer side here interoperates with SGLang's native receiver and with
rlinfer's own receiver (used by the vLLM backend). Tensors travel one broadcast per tensor, in
the order of the :class:`~rlinfer_core.weights.BroadcastSource` specs.

Trainer side::

    group = BroadcastGroup("127.0.0.1", free_port(), world_size=2, backend="gloo")
    # engine.init_weight_broadcast(group) must run concurrently: both sides block until joined
    sender = WeightBroadcaster(group)
    task = engine.update_weights(sender.source(named_tensors))   # the engine starts receiving
    sender.send(named_tensors)                                     # concurrently
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlinfer_core.weights import BroadcastGroup, BroadcastSource, TensorSpec, specs_of

if TYPE_CHECKING:
    import torch


def free_port() -> int:
    """A TCP port that is free on this host now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def create_group(group: BroadcastGroup, rank: int) -> Any:
    """Join the weight group as ``rank``; blocks until all ``world_size`` ranks joined."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = datetime.timedelta(seconds=group.timeout_s)
    url = f"tcp://{group.master_addr}:{group.master_port}"
    store, rank, world_size = next(rendezvous(url, rank, group.world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group.group_name, store)
    # The one private call: torch offers no public way to build a group outside the default
    # world; this mirrors SGLang's init_custom_process_group so the two sides match.
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(group.backend),
        store,
        group_name=group.group_name,  # type: ignore[arg-type]
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: Any) -> None:
    """Tear a weight group down."""
    import torch.distributed as dist

    dist.destroy_process_group(pg)


class WeightBroadcaster:
    """Trainer side (rank 0) of a weight group."""

    def __init__(self, group: BroadcastGroup) -> None:
        self.group = group
        self._pg = create_group(group, rank=0)

    @staticmethod
    def source(tensors: Sequence[tuple[str, torch.Tensor]]) -> BroadcastSource:
        """The BroadcastSource describing what :meth:`send` will send, in that order."""
        return BroadcastSource(specs_of(tensors))

    def send(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Broadcast every tensor, in order (must match the BroadcastSource given to the engine).

        Raises :class:`~rlinfer_core.errors.EngineTimeout` when the broadcast has not completed
        within the group's ``timeout_s`` (e.g. an engine rank that never joined the NCCL
        communicator); the group is then unusable: close it and build a new one.
        """
        import time

        import torch.distributed as dist

        deadline = time.monotonic() + self.group.timeout_s
        works = [dist.broadcast(t.detach().contiguous(), src=0, group=self._pg, async_op=True) for _, t in tensors]
        for work in works:
            wait_until(work, deadline, "the engine's ranks did not take the trainer's broadcast")

    def close(self) -> None:
        """Destroy the group."""
        destroy_group(self._pg)


def receive(pg: Any, specs: Sequence[TensorSpec], device: str | torch.device = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive tensors broadcast by rank 0, in ``specs`` order."""
    import torch
    import torch.distributed as dist

    from rlinfer_core.transfer.buckets import to_dtype

    out = [(s.name, torch.empty(s.shape, dtype=to_dtype(s.dtype), device=device)) for s in specs]
    works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in out]
    for work in works:
        work.wait()
    return out


def wait_until(work: Any, deadline: float, what: str) -> None:
    """Wait for a torch.distributed ``work`` until ``deadline`` (``time.monotonic()``)."""
    import time

    from rlinfer_core.errors import EngineTimeout

    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        completed = work.wait(timeout=datetime.timedelta(seconds=remaining))
    except RuntimeError as exc:
        raise EngineTimeout(f"{what} before the deadline ({exc})") from exc
    if completed is False:  # gloo answers False on a timeout instead of raising
        raise EngineTimeout(f"{what} before the deadline")


class GroupReceiver:
    """A non-zero rank of a torch.distributed weight group, as a
    :class:`~rlinfer_core.transfer.vllm_wire.Receiver` (CPU tensors: the gloo variant)."""

    def __init__(self, group: BroadcastGroup, rank: int) -> None:
        self._pg = create_group(group, rank)

    @property
    def device(self) -> torch.device:
        """Received tensors live on the CPU."""
        import torch

        return torch.device("cpu")

    def receive_into(self, tensor: torch.Tensor, deadline: float) -> None:
        """Fill ``tensor`` from rank 0's next broadcast, waiting at most until ``deadline``."""
        import torch.distributed as dist

        work = dist.broadcast(tensor, src=0, group=self._pg, async_op=True)
        wait_until(work, deadline, "the trainer's broadcast did not arrive")

    def close(self) -> None:
        """Destroy the group."""
        destroy_group(self._pg)
