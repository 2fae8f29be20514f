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

No side waits longer than the group's ``timeout_s``: both :meth:`WeightBroadcaster.send` and
:func:`receive` raise :class:`~rlinfer_core.errors.EngineTimeout` then, and say how far the
broadcast got. torch creates an NCCL communicator inside the first collective call, and that call
blocks, without any timeout, until every rank made it; so the broadcasts are issued and awaited
in a helper thread, and a thread still blocked there at the deadline is left behind (nothing can
cancel it). A group that timed out is broken: :func:`destroy_group` then aborts it without
waiting on it, and a later broadcast on it is refused.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlinfer_core.weights import BroadcastGroup, BroadcastSource, TensorSpec, specs_of

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: torch's own NCCL watchdog gets this much longer than the group's timeout_s: the group's
#: deadline must fire first, so that a late rank becomes an EngineTimeout and an aborted group,
#: not a watchdog that tears the whole process (an engine's) down (TORCH_NCCL_ASYNC_ERROR_HANDLING)
WATCHDOG_MARGIN_S = 60.0
#: how long the caller waits past the deadline for the helper thread to report its own timeout
_REPORT_GRACE_S = 5.0
#: how long tearing a broken group down may take before it is left to a daemon thread
_ABANDON_WAIT_S = 5.0

#: each group made by create_group: its timeout_s (the deadline of every broadcast on it)
_TIMEOUTS: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
#: groups whose broadcast failed or timed out: why (torch cannot use them again)
_BROKEN: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


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
    # NCCL only: a gloo operation left pending past the deadline would hold its group (and an
    # abort of it) for the margin too
    margin = WATCHDOG_MARGIN_S if group.backend == "nccl" else 0.0
    watchdog = datetime.timedelta(seconds=group.timeout_s + margin)
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
        timeout=watchdog,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    _TIMEOUTS[pg] = group.timeout_s
    return pg


def destroy_group(pg: Any) -> None:
    """Tear this process's side of a weight group down, without waiting for the other ranks.

    A gloo group is destroyed. An NCCL group, or a broken one (a broadcast on it failed), is
    aborted in a daemon thread, waited for at most a few seconds: NCCL's graceful destroy may wait
    for the other ranks (on two H100s a trainer hung in it while the vLLM worker kept its side of
    the group, as engines do until they join the next one), and a rank of a broken group may still
    be blocked inside it. Every broadcast on the group has completed or failed by then
    (:func:`broadcast_by` waits), so nothing is cut short."""
    import torch.distributed as dist

    if pg not in _BROKEN and dist.get_backend(pg) != "nccl":
        dist.destroy_process_group(pg)
        return
    done = threading.Event()

    def abort() -> None:
        from torch.distributed import distributed_c10d as c10d

        try:
            getattr(c10d, "_abort_process_group", dist.destroy_process_group)(pg)
        except Exception as exc:  # a broken group may refuse even that; nothing else holds it
            logger.warning("aborting a weight group failed: %s", exc)
        finally:
            done.set()

    threading.Thread(target=abort, name="rlinfer-abort-weight-group", daemon=True).start()
    if not done.wait(_ABANDON_WAIT_S):
        logger.warning("a weight group is still being aborted after %.0f s; left behind", _ABANDON_WAIT_S)


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
        deadline = time.monotonic() + self.group.timeout_s
        sent = [t.detach().contiguous() for _, t in tensors]
        broadcast_by(self._pg, sent, deadline, "the engine's ranks did not take the trainer's broadcast")

    def close(self) -> None:
        """Destroy the group."""
        destroy_group(self._pg)


def receive(pg: Any, specs: Sequence[TensorSpec], device: str | torch.device = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive tensors broadcast by rank 0, in ``specs`` order, by the deadline of
    the group's ``timeout_s`` (:class:`~rlinfer_core.errors.EngineTimeout` after it; the group is
    broken then: join a new one). Nothing is written outside the returned tensors."""
    import torch

    from rlinfer_core.transfer.buckets import to_dtype

    timeout_s = _TIMEOUTS.get(pg)
    if timeout_s is None:
        raise ValueError("receive() takes a weight group made by create_group (it carries the deadline)")
    deadline = time.monotonic() + timeout_s
    out = [(s.name, torch.empty(s.shape, dtype=to_dtype(s.dtype), device=device)) for s in specs]
    broadcast_by(pg, [t for _, t in out], deadline, "the trainer's broadcast did not arrive")
    return out


def broadcast_by(pg: Any, tensors: Sequence[torch.Tensor], deadline: float, what: str) -> None:
    """Broadcast ``tensors`` from rank 0 over ``pg`` (send on rank 0, receive elsewhere) and wait
    for every one, until ``deadline`` (``time.monotonic()``), in a helper thread (see the module
    doc). Raises :class:`~rlinfer_core.errors.EngineTimeout` naming how far it got; any failure
    marks ``pg`` broken."""
    from rlinfer_core.errors import EngineTimeout, WeightUpdateError

    if pg in _BROKEN:
        raise WeightUpdateError(f"this weight group is broken ({_BROKEN[pg]}): join a new one")
    progress = [0, 0]  # broadcasts issued, completed
    outcome: concurrent.futures.Future[None] = concurrent.futures.Future()
    # NCCL orders a collective after the work queued on the issuing thread's current stream, and
    # a wait orders that stream after it: the helper thread takes the caller's device and stream
    stream = _current_stream(tensors)

    def run() -> None:
        import contextlib

        import torch
        import torch.distributed as dist

        try:
            if stream is not None:
                torch.cuda.set_device(stream.device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                works = []
                for t in tensors:
                    works.append(dist.broadcast(t, src=0, group=pg, async_op=True))
                    progress[0] += 1
                for work in works:
                    wait_until(work, deadline, what)
                    progress[1] += 1
            outcome.set_result(None)
        except BaseException as exc:
            outcome.set_exception(exc)

    threading.Thread(target=run, name="rlinfer-weight-broadcast", daemon=True).start()
    try:
        outcome.result(timeout=max(deadline - time.monotonic(), 0.0) + _REPORT_GRACE_S)
    except BaseException as exc:
        stage = _stage(progress[0], progress[1], len(tensors))
        if not outcome.done():  # the helper thread is still blocked inside torch
            _BROKEN[pg] = "timed out"
            raise EngineTimeout(f"{what} before the deadline: {stage}") from None
        _BROKEN[pg] = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, EngineTimeout) or _is_store_timeout(exc):
            raise EngineTimeout(f"{exc}: {stage}") from exc
        raise


def _current_stream(tensors: Sequence[torch.Tensor]) -> Any:
    """The calling thread's current CUDA stream on the tensors' device (None for CPU tensors)."""
    if not tensors or not tensors[0].is_cuda:
        return None
    import torch

    return torch.cuda.current_stream(tensors[0].device)


def _stage(issued: int, completed: int, total: int) -> str:
    """Where a broadcast that missed its deadline stood, in words that name the likely cause."""
    if issued == 0 and total:
        return (
            "still inside the first broadcast call, where torch creates the group's communicator "
            "(NCCL: every rank must reach it; a rank that never did, or NCCL unable to connect the "
            "ranks; NCCL_DEBUG=INFO tells which)"
        )
    return f"{completed} of {total} broadcasts completed ({issued} issued)"


def _is_store_timeout(exc: BaseException) -> bool:
    """torch's store gave up waiting for a key (e.g. rank 0's NCCL id, when rank 0 never
    broadcast): a timeout of the peer, not a fault of this rank."""
    import torch.distributed as dist

    store_error = getattr(dist, "DistStoreError", None)
    return store_error is not None and isinstance(exc, store_error)


def wait_until(work: Any, deadline: float, what: str) -> None:
    """Wait for a torch.distributed ``work`` until ``deadline`` (``time.monotonic()``)."""
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
