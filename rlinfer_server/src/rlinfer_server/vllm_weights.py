"""The vLLM dialect's weight-transfer lifecycle: init -> start -> update* -> finish.

The server process joins the trainer's torch.distributed group as rank ``rank_offset`` (one rank
per server; the trainer is rank 0 and hosts the rendezvous), receives each ``/update_weights``
call's tensors as rank 0 broadcasts them (one broadcast per tensor, in ``names`` order), and on
``/finish_weight_update`` loads all of them as one rlinfer update (validated first, all or
nothing, with the version given). Out-of-order calls are 409, as in vLLM's RL state machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.weights import BroadcastGroup, NamedTensors, TensorSpec
from rlinfer_server.app import ServerState
from rlinfer_server.dialect_common import VersionConflict, apply_update

#: init_info keys of vLLM's NCCL backend, and the one rlinfer adds (``backend``: gloo on CPU)
INIT_KEYS = frozenset({"master_address", "master_port", "rank_offset", "world_size", "backend", "group_name"})
PACKED_KEYS = frozenset({"packed", "packed_buffer_size_bytes", "packed_num_buffers"})


class OutOfOrder(VersionConflict):
    """A lifecycle call out of order (409)."""


class WeightSession:
    """One server's weight group and the update in progress."""

    def __init__(self) -> None:
        self._group: Any = None
        self._timeout_s = 120.0
        self._received: list[tuple[str, Any]] | None = None

    async def init(self, state: ServerState, init_info: dict[str, Any]) -> None:
        """Join the trainer's group (blocks until every rank joined, or the deadline)."""
        from rlinfer_core.transfer.broadcast import create_group

        unknown = set(init_info) - INIT_KEYS - PACKED_KEYS
        if unknown:
            raise InvalidRequest(f"init_info.{sorted(unknown)[0]}", f"unknown key; known: {sorted(INIT_KEYS)}")
        if init_info.get("packed"):
            raise InvalidRequest("init_info.packed", "packed transfers are not served yet: send packed=false")
        missing = {"master_address", "master_port", "rank_offset", "world_size"} - set(init_info)
        if missing:
            raise InvalidRequest(f"init_info.{sorted(missing)[0]}", "is required")
        default_backend = "nccl" if state.engine.config.device != "cpu" and _has_cuda() else "gloo"
        group = BroadcastGroup(
            master_addr=str(init_info["master_address"]),
            master_port=int(init_info["master_port"]),
            world_size=int(init_info["world_size"]),
            backend=init_info.get("backend", default_backend),
            group_name=str(init_info.get("group_name", "weight_update_group")),
            rank_offset=int(init_info["rank_offset"]),
        )
        self._timeout_s = group.timeout_s
        self._group = await asyncio.to_thread(create_group, group, group.rank_offset)

    def start(self, state: ServerState) -> None:
        """Open an update."""
        if self._received is not None:
            raise OutOfOrder("start_weight_update", "an update is already in progress: finish it first")
        state.engine  # noqa: B018  (503 when the engine is not running)
        self._received = []

    async def receive(self, update_info: Any) -> None:
        """Receive one call's tensors (a dict, or a list of dicts) from rank 0."""
        from rlinfer_core.transfer.broadcast import receive

        if self._received is None:
            raise OutOfOrder("update_weights", "no update in progress: POST /start_weight_update first")
        if self._group is None:
            raise InvalidRequest("update_weights", "no weight group: POST /init_weight_transfer_engine first")
        chunks = update_info if isinstance(update_info, list) else [update_info]
        for chunk in chunks:
            specs = _specs(chunk)
            tensors = await asyncio.wait_for(
                asyncio.to_thread(receive, self._group, specs), timeout=self._timeout_s + 5
            )
            self._received.extend(tensors)

    async def finish(self, state: ServerState, version: int | None) -> None:
        """Load everything received, all or nothing; the update is closed either way."""
        if self._received is None:
            raise OutOfOrder("finish_weight_update", "no update in progress: POST /start_weight_update first")
        received, self._received = self._received, None
        if not received:
            raise InvalidRequest("update_weights", "no tensors were received in this update")
        await apply_update(state, NamedTensors(tuple(received)), version, "broadcast")


def _specs(chunk: Any) -> tuple[TensorSpec, ...]:
    if not isinstance(chunk, dict):
        raise InvalidRequest("update_info", f"must be an object (or a list of them), got {type(chunk).__name__}")
    if chunk.get("packed") or set(chunk) & (PACKED_KEYS - {"packed"}):
        raise InvalidRequest("update_info.packed", "packed transfers are not served yet: send packed=false")
    names, dtypes, shapes = chunk.get("names"), chunk.get("dtype_names"), chunk.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise InvalidRequest("update_info.names", "names, dtype_names and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequest("update_info.names", "names, dtype_names and shapes must have the same length")
    return tuple(
        TensorSpec(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    )


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def session_of(app: FastAPI) -> WeightSession:
    """The app's weight session (made on first use)."""
    session = getattr(app.state, "vllm_weight_session", None)
    if session is None:
        session = WeightSession()
        app.state.vllm_weight_session = session
    assert isinstance(session, WeightSession)
    return session
