"""One replica: an :class:`rlinfer_core.engine.AsyncEngine` of any backend inside a Ray actor.

The actor answers every call with ``("ok", value)`` or ``("err", packed_error)`` so that the
contract's typed errors (InvalidRequest with its field, WeightUpdateError with its problems, ...)
reach the pool as the same types, whatever their constructors take. An actor that dies shows up
on the pool side as Ray's ``RayActorError``; :func:`is_replica_death` names both ways a replica
can be gone.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs

from rlinfer_core import errors
from rlinfer_core.types import EngineConfig, GenerateRequest

Reply = tuple[str, Any]

#: how long an abort keeps re-aborting requests that are still in flight
ABORT_SETTLE_S = 2.0
#: attributes of an rlinfer error that are carried along with its message
_ERROR_ATTRS = ("field", "problems", "capability", "backend", "reason")
#: engine_kwargs a replica's engine gets for tensor_parallel_size > 1 unless the caller set them.
#: vLLM picks its Ray executor when it starts inside a Ray placement group (a replica does):
#: that executor would place the TP workers as new actors in the replica's own bundle, whose GPUs
#: the replica already holds. Its multiprocessing executor runs them on the GPUs Ray gave the
#: replica (CUDA_VISIBLE_DEVICES), as a single engine would.
TP_ENGINE_KWARGS: Mapping[str, Mapping[str, Any]] = {"vllm": {"distributed_executor_backend": "mp"}}


def replica_config(backend: str, config: EngineConfig) -> EngineConfig:
    """``config`` with :data:`TP_ENGINE_KWARGS` filled in where they apply."""
    if config.tensor_parallel_size <= 1:
        return config
    missing = {k: v for k, v in TP_ENGINE_KWARGS.get(backend, {}).items() if k not in config.engine_kwargs}
    if not missing:
        return config
    return attrs.evolve(config, engine_kwargs={**config.engine_kwargs, **missing})


def pack_error(exc: BaseException) -> dict[str, Any]:
    """A picklable description of ``exc`` that :func:`unpack_error` turns back into its type."""
    return {
        "type": type(exc).__name__ if isinstance(exc, errors.RLInferError) else "RLInferError",
        "message": str(exc) if isinstance(exc, errors.RLInferError) else f"{type(exc).__name__}: {exc}",
        "attrs": {k: getattr(exc, k) for k in _ERROR_ATTRS if hasattr(exc, k)},
    }


def unpack_error(packed: Mapping[str, Any], where: str = "") -> errors.RLInferError:
    """The typed rlinfer error described by ``packed`` (message prefixed with ``where``)."""
    cls = getattr(errors, str(packed.get("type")), errors.RLInferError)
    if not (isinstance(cls, type) and issubclass(cls, errors.RLInferError)):
        cls = errors.RLInferError
    exc = cls.__new__(cls)
    Exception.__init__(exc, f"{where}{packed['message']}")
    for key, value in dict(packed.get("attrs", {})).items():
        setattr(exc, key, value)
    return exc


def is_replica_death(exc: BaseException) -> bool:
    """True when ``exc`` means the replica can no longer serve (its actor or its engine died)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError

    return isinstance(
        exc, RayActorError | ActorDiedError | ActorUnavailableError | WorkerCrashedError | errors.EngineDead
    )


class ReplicaActor:
    """The body of the replica actor (made remote by the pool with its placement options)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.engine: Any = None
        #: the engine's open staged updates, by the pool's staging id (rlinfer_ray.staging)
        self.stagings: dict[str, Any] = {}

    async def start(self, backend: str, config: EngineConfig) -> Reply:
        """Open the engine; returns what the pool mirrors (capabilities, model info, specs)."""
        from rlinfer_core.engine import AsyncEngine

        try:
            self.engine = await AsyncEngine.open(
                backend, replica_config(backend, config), load_entry_point_plugins=False
            )
            return (
                "ok",
                {
                    "capabilities": self.engine.capabilities,
                    "model_info": self.engine.model_info,
                    "weight_specs": dict(self.engine.weight_specs),
                    "pid": os.getpid(),
                    "node_id": _node_id(),
                    "procs": self._engine_procs(),
                },
            )
        except Exception as exc:
            return ("err", pack_error(exc))

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Reply:
        """Await ``engine.method(*args, **kwargs)`` (or read a property when ``method`` names one)."""
        try:
            if self.engine is None:
                raise errors.EngineDead(f"replica {self.index} has no engine (start failed or not called)")
            target = getattr(self.engine, method)
            value = target(*args, **kwargs) if callable(target) else target
            if asyncio.iscoroutine(value):
                value = await value
            return ("ok", dict(value) if isinstance(value, Mapping) else value)
        except Exception as exc:
            return ("err", pack_error(exc))

    async def staging(self, op: str, staging_id: str, *args: Any, **kwargs: Any) -> Reply:
        """A staged update on this replica's engine, its handle kept here under the pool's
        ``staging_id``: ``stage`` (update, version=...), ``add`` (update), ``commit``, ``cancel``
        (nothing to do when nothing is staged under the id). Replies with the staged bytes, or
        with the version a commit made live."""
        try:
            if self.engine is None:
                raise errors.EngineDead(f"replica {self.index} has no engine")
            value: Any = None
            if op == "stage":
                handle = await self.engine.stage_weights(*args, **kwargs)
                self.stagings[staging_id] = handle
                value = handle.staged_bytes
            elif op == "add":
                value = await self.stagings[staging_id].add(*args)
            elif op == "commit":
                value = await self.stagings.pop(staging_id).commit()
            elif op == "cancel":
                handle = self.stagings.pop(staging_id, None)
                if handle is not None:
                    await handle.cancel()
            else:
                raise ValueError(f"unknown staging op {op!r}")
            return ("ok", value)
        except Exception as exc:
            if op in ("add", "commit") and staging_id in self.stagings and self.stagings[staging_id].state != "open":
                self.stagings.pop(staging_id)  # the engine ended it (a failure inside the engine)
            return ("err", pack_error(exc))

    async def abort(self, request_ids: list[str] | None) -> Reply:
        """Abort, then abort again (briefly) what is still in flight: a request the facade had
        admitted but the engine had not registered yet when the first abort came is not lost."""
        try:
            if self.engine is None:
                raise errors.EngineDead(f"replica {self.index} has no engine")
            targets = set(self.engine.in_flight if request_ids is None else request_ids)
            await self.engine.abort(request_ids)
            deadline = time.monotonic() + ABORT_SETTLE_S
            while (left := targets & self.engine.in_flight) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                await self.engine.abort(sorted(left))
            return ("ok", None)
        except Exception as exc:
            return ("err", pack_error(exc))

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Reply]:
        """Stream one request's deltas (a Ray streaming generator)."""
        try:
            async for delta in self.engine.stream(request):
                yield ("ok", delta)
        except Exception as exc:
            yield ("err", pack_error(exc))

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()

    def _engine_procs(self) -> list[tuple[int, float]]:
        """(pid, start time) of the engine's processes (Ray kills them with the actor's process group)."""
        import psutil

        try:
            pids = list(self.engine.engine_processes().values())
        except errors.RLInferError:  # the backend does not report them
            return []
        out = []
        for pid in pids:
            try:
                out.append((pid, psutil.Process(pid).create_time()))
            except psutil.Error:
                continue
        return out


def _node_id() -> str | None:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None
