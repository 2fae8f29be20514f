"""The vLLM dialect's weight-transfer lifecycle: init -> start -> update* -> finish.

The server process joins the trainer's group as rank ``rank_offset`` (one rank per server; the
trainer is rank 0 and hosts the rendezvous), receives each ``/update_weights`` call's tensors as
rank 0 broadcasts them, and on ``/finish_weight_update`` loads all of them as one rlinfer update
(validated first, all or nothing, with the version given). Out-of-order calls are 409, as in
vLLM's RL state machine.

Two transports (``init_info.backend``): ``nccl`` — vLLM's own wire
(:mod:`rlinfer_core.transfer.vllm_wire`: its StatelessProcessGroup rendezvous or a
``nccl_unique_id_b64``, one broadcast per tensor or packed buffers), the default where CUDA is
available, so vLLM's trainer side and TRL's ``VLLMClient`` drive it unchanged; ``gloo`` — the
same tensors and packing over a torch.distributed gloo group (built as SGLang builds its weight
group), rlinfer's variant for CPU trainers. Packing is set in ``init_info`` (vLLM >= 0.28) or per
call in ``update_info`` (vLLM 0.26 and TRL over it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Mapping
from typing import Any

import attrs
from fastapi import FastAPI

from rlinfer_core.errors import EngineTimeout, InvalidRequest
from rlinfer_core.transfer.nccl_lib import NCCL_UNIQUE_ID_BYTES
from rlinfer_core.transfer.vllm_wire import DEFAULT_PACKED_BUFFER_SIZE_BYTES, Receiver
from rlinfer_core.types import EngineConfig
from rlinfer_core.weights import BroadcastGroup, NamedTensors, TensorSpec
from rlinfer_server.app import ServerState
from rlinfer_server.dialect_common import VersionConflict, apply_update

#: init_info keys of vLLM's NCCL backend, and those rlinfer adds (``backend``, ``group_name``, and
#: ``timeout_s``: the deadline of the join and of each call's transfer)
INIT_KEYS = frozenset(
    {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "nccl_unique_id_b64",
        "backend",
        "group_name",
        "timeout_s",
    }
)
PACKED_KEYS = frozenset({"packed", "packed_buffer_size_bytes", "packed_num_buffers"})
UPDATE_KEYS = frozenset({"names", "dtype_names", "shapes"}) | PACKED_KEYS
DEFAULT_TIMEOUT_S = 120.0


class OutOfOrder(VersionConflict):
    """A lifecycle call out of order (409)."""


@attrs.frozen
class Packing:
    """Whether tensors come packed, and the buffer size both sides cut at."""

    packed: bool = False
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES

    def overridden_by(self, info: dict[str, Any], where: str) -> Packing:
        """These settings, with those ``info`` names replacing them."""
        packed = info.get("packed", self.packed)
        size = info.get("packed_buffer_size_bytes", self.buffer_size_bytes)
        if not isinstance(packed, bool):
            raise InvalidRequest(f"{where}.packed", f"must be true or false, got {packed!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidRequest(f"{where}.packed_buffer_size_bytes", f"must be a positive integer, got {size!r}")
        num = info.get("packed_num_buffers", 1)
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise InvalidRequest(f"{where}.packed_num_buffers", f"must be a positive integer, got {num!r}")
        return Packing(packed, size)


class WeightSession:
    """One server's weight group and the update in progress."""

    def __init__(self) -> None:
        self._receiver: Receiver | None = None
        self._packing = Packing()
        self._timeout_s = DEFAULT_TIMEOUT_S
        self._received: list[tuple[str, Any]] | None = None

    async def init(self, state: ServerState, init_info: dict[str, Any]) -> None:
        """Join the trainer's group (blocks until every rank joined, or the deadline)."""
        unknown = set(init_info) - INIT_KEYS - PACKED_KEYS
        if unknown:
            known = sorted(INIT_KEYS | PACKED_KEYS)
            raise InvalidRequest(f"init_info.{sorted(unknown)[0]}", f"unknown key; known: {known}")
        missing = {"rank_offset", "world_size"} - set(init_info)
        if missing:
            raise InvalidRequest(f"init_info.{sorted(missing)[0]}", "is required")
        packing = Packing().overridden_by(init_info, "init_info")
        backend = init_info.get("backend") or default_weight_backend(state.engine.config)
        if backend not in ("nccl", "gloo"):
            raise InvalidRequest("init_info.backend", f"must be 'nccl' or 'gloo', got {backend!r}")
        rank, world_size = (whole_number(init_info, key) for key in ("rank_offset", "world_size"))
        if not 1 <= rank < world_size:
            raise InvalidRequest("init_info.rank_offset", f"must be in 1..world_size-1 ({world_size - 1}), got {rank}")
        timeout_s = init_info.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= 3600:
            raise InvalidRequest("init_info.timeout_s", f"must be a number of seconds in (0, 3600], got {timeout_s!r}")
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if backend == "nccl":
            self._receiver = await asyncio.to_thread(_join_nccl, init_info, rank, world_size, float(timeout_s))
        else:
            self._receiver = await asyncio.to_thread(_join_gloo, init_info, rank, world_size, float(timeout_s))
        self._packing, self._timeout_s = packing, float(timeout_s)

    def start(self, state: ServerState) -> None:
        """Open an update."""
        if self._received is not None:
            raise OutOfOrder("start_weight_update", "an update is already in progress: finish it first")
        state.engine  # noqa: B018  (503 when the engine is not running)
        self._received = []

    async def receive(self, update_info: Any) -> None:
        """Receive one call's tensors (a dict, or a list of dicts) from rank 0."""
        from rlinfer_core.transfer.vllm_wire import receive_tensors

        if self._received is None:
            raise OutOfOrder("update_weights", "no update in progress: POST /start_weight_update first")
        if self._receiver is None:
            raise InvalidRequest("update_weights", "no weight group: POST /init_weight_transfer_engine first")
        chunks = update_info if isinstance(update_info, list) else [update_info]
        plans = [(_specs(chunk), self._packing.overridden_by(chunk, "update_info")) for chunk in chunks]
        receiver = self._receiver
        try:
            for specs, packing in plans:
                size = packing.buffer_size_bytes if packing.packed else None
                tensors = await asyncio.wait_for(
                    asyncio.to_thread(receive_tensors, receiver, specs, size, self._timeout_s),
                    timeout=self._timeout_s + 5,
                )
                self._received.extend(tensors)
        except BaseException as exc:
            # A transfer cut short leaves the group's stream position unknown: the update is
            # dropped (the old weights keep serving) and the group must be joined again.
            self._received = None
            self._receiver = None
            receiver.close()
            if isinstance(exc, TimeoutError):
                raise EngineTimeout("the trainer's broadcast did not arrive before the deadline") from exc
            raise

    async def finish(self, state: ServerState, version: int | None) -> None:
        """Load everything received, all or nothing; the update is closed either way."""
        if self._received is None:
            raise OutOfOrder("finish_weight_update", "no update in progress: POST /start_weight_update first")
        received, self._received = self._received, None
        if not received:
            raise InvalidRequest("update_weights", "no tensors were received in this update")
        await apply_update(state, NamedTensors(tuple(received)), version, "broadcast")


def _join_nccl(init_info: dict[str, Any], rank: int, world_size: int, timeout_s: float) -> Receiver:
    from rlinfer_core.transfer.vllm_wire import VllmNcclReceiver

    encoded = init_info.get("nccl_unique_id_b64")
    has_address = "master_address" in init_info or "master_port" in init_info
    if encoded is not None and has_address:
        raise InvalidRequest("init_info.nccl_unique_id_b64", "give it or master_address/master_port, not both")
    if encoded is None:
        if not ("master_address" in init_info and "master_port" in init_info):
            raise InvalidRequest("init_info.master_address", "give master_address and master_port, or a unique id")
        return VllmNcclReceiver.join(
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            master_address=str(init_info["master_address"]),
            master_port=int(init_info["master_port"]),
        )
    try:
        unique_id = base64.b64decode(str(encoded), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest("init_info.nccl_unique_id_b64", "is not standard base64") from exc
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise InvalidRequest("init_info.nccl_unique_id_b64", f"must decode to {NCCL_UNIQUE_ID_BYTES} bytes")
    return VllmNcclReceiver.join(rank=rank, world_size=world_size, timeout_s=timeout_s, unique_id=unique_id)


def _join_gloo(init_info: dict[str, Any], rank: int, world_size: int, timeout_s: float) -> Receiver:
    from rlinfer_core.transfer.broadcast import GroupReceiver

    missing = {"master_address", "master_port"} - set(init_info)
    if missing:
        raise InvalidRequest(f"init_info.{sorted(missing)[0]}", "is required for the gloo group")
    group = BroadcastGroup(
        master_addr=str(init_info["master_address"]),
        master_port=int(init_info["master_port"]),
        world_size=world_size,
        backend="gloo",
        group_name=str(init_info.get("group_name", "weight_update_group")),
        timeout_s=timeout_s,
        rank_offset=rank,
    )
    return GroupReceiver(group, rank)


def _specs(chunk: Any) -> tuple[TensorSpec, ...]:
    if not isinstance(chunk, dict):
        raise InvalidRequest("update_info", f"must be an object (or a list of them), got {type(chunk).__name__}")
    unknown = set(chunk) - UPDATE_KEYS
    if unknown:
        raise InvalidRequest(f"update_info.{sorted(unknown)[0]}", f"unknown key; known: {sorted(UPDATE_KEYS)}")
    names, dtypes, shapes = chunk.get("names"), chunk.get("dtype_names"), chunk.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise InvalidRequest("update_info.names", "names, dtype_names and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequest("update_info.names", "names, dtype_names and shapes must have the same length")
    return tuple(
        TensorSpec(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    )


def default_weight_backend(config: EngineConfig) -> str:
    """vLLM's NCCL wire where the engine runs on a GPU this process can use, else gloo."""
    import torch

    return "nccl" if config.device != "cpu" and torch.cuda.is_available() else "gloo"


def session_of(app: FastAPI) -> WeightSession:
    """The app's weight session (made on first use)."""
    session = getattr(app.state, "vllm_weight_session", None)
    if session is None:
        session = WeightSession()
        app.state.vllm_weight_session = session
    assert isinstance(session, WeightSession)
    return session


def whole_number(info: Mapping[str, Any], key: str) -> int:
    """``info[key]`` as an int: an integer, or a string of one; anything else is InvalidRequest (a 400)."""
    value = info[key]
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidRequest(f"init_info.{key}", f"must be a whole number, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise InvalidRequest(f"init_info.{key}", f"must be a whole number, got {value!r}") from None
