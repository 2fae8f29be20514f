"""One replica: the bare backend object of any rlinfer backend inside a Ray actor.

The facade (validation, admission, versions, stagings, the pause gate) runs once, in the pool's
process; a replica only forwards the operation hooks the pool calls to its backend. Two things
stay here because only the replica can do them: an update (or a staged commit) is verified
against the tensors it carried when ``EngineConfig.verify_updates`` is on (the replica holds
them; a replica that does not serve them fails the load and is restarted), and an untyped
failure of a hook is reported as EngineDead when the engine no longer answers its health check
(so the pool retries the work elsewhere and restarts the replica).

The actor answers every call with ``("ok", value)`` or ``("err", packed_error)`` so that the
contract's typed errors (InvalidRequest with its field, WeightUpdateError with its problems, ...)
reach the pool as the same types, whatever their constructors take. An actor that dies shows up
on the pool side as Ray's ``RayActorError``; :func:`is_replica_death` names both ways a replica
can be gone.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

import attrs

from rlinfer_core import errors
from rlinfer_core.types import Capability, EngineConfig, GenerateRequest
from rlinfer_core.weights import BroadcastSource, WeightSource, WeightUpdate

Reply = tuple[str, Any]

#: how long a replica waits for its engine's health check after an untyped failure
HEALTH_TIMEOUT_S = 10.0
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
        self.backend: Any = None
        self.config: EngineConfig | None = None
        self.verify = False
        self.tied: Mapping[str, str] = {}
        #: the sources staged under each open staging id (verified at commit)
        self.staged: dict[str, list[WeightSource]] = {}

    async def start(self, backend: str, config: EngineConfig) -> Reply:
        """Build and start the backend; returns what the pool mirrors (capabilities, model info, specs)."""
        from rlinfer_core.backend import claimed_but_missing
        from rlinfer_core.discovery import get_backend

        try:
            info = get_backend(backend)
            self.config = replica_config(backend, config)
            self.backend = info.create(self.config)
            await self.backend.rlinfer_start(self.config)
            capabilities = self.backend.rlinfer_capabilities()
            dishonest = claimed_but_missing(self.backend, capabilities.supported)
            if dishonest:
                raise errors.BackendLoadError(
                    f"backend {backend!r} claims capabilities without their hooks: {dishonest}"
                )
            model_info = self.backend.rlinfer_model_info()
            self.verify = config.verify_updates and capabilities.supports(Capability.WEIGHTS_CHECKSUM)
            self.tied = model_info.tied_weights
            return (
                "ok",
                {
                    "capabilities": capabilities,
                    "model_info": model_info,
                    "weight_specs": dict(self.backend.rlinfer_weight_specs()),
                    "invalidates_prefixes": bool(getattr(self.backend, "update_invalidates_prefixes", False)),
                    "pid": os.getpid(),
                    "node_id": _node_id(),
                    "procs": self._engine_procs(),
                },
            )
        except Exception as exc:
            return ("err", pack_error(exc))

    async def call(self, hook: str, *args: Any) -> Reply:
        """Await the backend's ``hook(*args)`` (a sync hook's value is returned as is)."""
        return await self._reply(lambda: getattr(self._engine(), hook)(*args))

    async def update_weights(self, source: WeightSource, version: int) -> Reply:
        """Load ``source`` (validated by the pool's facade) as ``version``, then verify it."""

        async def load() -> None:
            await self._engine().rlinfer_update_weights(WeightUpdate(source, version=version))
            await self._verify([source])

        return await self._reply(load)

    async def staging(self, op: str, staging_id: str, *args: Any) -> Reply:
        """A staged update on this replica's backend: ``stage`` (source, version), ``commit``
        (version; then verified), ``cancel`` (nothing to do when nothing is staged under the id)."""

        async def run() -> None:
            engine = self._engine()
            if op == "stage":
                source, version = args
                self.staged.setdefault(staging_id, []).append(source)
                await engine.rlinfer_stage_weights(staging_id, WeightUpdate(source, version=version))
            elif op == "commit":
                await engine.rlinfer_commit_staged_weights(staging_id, *args)
                await self._verify(self.staged.pop(staging_id, []))
            elif op == "cancel":
                if self.staged.pop(staging_id, None) is not None:
                    await engine.rlinfer_cancel_staged_weights(staging_id)
            else:
                raise ValueError(f"unknown staging op {op!r}")

        return await self._reply(run)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Reply]:
        """Stream one request's deltas (a Ray streaming generator)."""
        try:
            async for delta in self._engine().rlinfer_generate_stream(request):
                yield ("ok", delta)
        except Exception as exc:
            yield ("err", pack_error(await self._typed(exc)))

    # --- helpers -------------------------------------------------------------------------------

    def _engine(self) -> Any:
        if self.backend is None:
            raise errors.EngineDead(f"replica {self.index} has no engine (start failed or not called)")
        return self.backend

    async def _reply(self, call: Any) -> Reply:
        try:
            value = call()
            if isinstance(value, Awaitable):
                value = await value
            return ("ok", dict(value) if isinstance(value, Mapping) else value)
        except Exception as exc:
            return ("err", pack_error(await self._typed(exc)))

    async def _typed(self, exc: Exception) -> BaseException:
        """``exc``, or EngineDead when it is untyped and the engine no longer answers."""
        if isinstance(exc, errors.RLInferError) or self.backend is None:
            return exc
        try:
            await asyncio.wait_for(self.backend.rlinfer_check_health(), timeout=HEALTH_TIMEOUT_S)
        except errors.EngineDead as dead:
            return dead
        except TimeoutError:
            return errors.EngineDead(f"replica {self.index}: the engine stopped answering after: {exc}")
        except Exception:
            return exc
        return exc

    async def _verify(self, sources: list[WeightSource]) -> None:
        """The engine's checksums of the tensors ``sources`` carried against those tensors."""
        from rlinfer_core.checksum import verify
        from rlinfer_core.engine_weights import sent_tensors

        sent = [pair for s in sources if not isinstance(s, BroadcastSource) for pair in sent_tensors(s)]
        if not self.verify or not sent:
            return
        result = verify(await self._engine().rlinfer_weights_checksum(), sent, self.tied)
        if not result.ok:
            raise errors.WeightVerificationError(
                f"replica {self.index} loaded the update but does not serve it as sent ({len(result.mismatched)} "
                f"tensors differ, {len(result.missing)} not reported)",
                result.mismatched,
                result.missing,
            )

    def _engine_procs(self) -> list[tuple[int, float]]:
        """(pid, start time) of the engine's processes (Ray kills them with the actor's process group)."""
        import psutil

        hook = getattr(self.backend, "rlinfer_engine_processes", None)
        if hook is None:
            return []
        try:
            pids = list(hook().values())
        except errors.RLInferError:  # the backend does not report them here
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
