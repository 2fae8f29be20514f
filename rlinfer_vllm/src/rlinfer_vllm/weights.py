"""The vLLM backend's weight hooks (a mixin): updates over every transport, checksums, the
broadcast group. Loading happens in the worker (:mod:`rlinfer_vllm.worker`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import attrs

from rlinfer_core.checksum import WeightChecksum
from rlinfer_core.errors import InvalidRequest, RLInferError, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.types import Capabilities, Capability, EngineConfig, PauseMode
from rlinfer_core.weights import (
    BroadcastGroup,
    BroadcastSource,
    Bucket,
    Buckets,
    CheckpointDir,
    NamedTensors,
    TensorSpec,
    WeightSource,
    WeightUpdate,
)
from rlinfer_vllm.capabilities import Platform
from rlinfer_vllm.versions import TokenVersions

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlinfer_vllm.load_gate import LoadGate

logger = logging.getLogger("rlinfer_vllm.backend")


class WeightHooks:
    """Weight-sync hooks of :class:`rlinfer_vllm.backend.VllmBackend`."""

    config: EngineConfig
    platform: Platform
    _caps: Capabilities
    _specs: dict[str, TensorSpec]
    _info: ModelInfo | None
    _versions: TokenVersions | None
    _pause_lock: asyncio.Lock
    _user_pause: PauseMode | None
    _gate: LoadGate

    def _alive(self) -> AsyncLLM:
        raise NotImplementedError

    async def _rpc(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    async def rlinfer_reset_prefix_cache(self) -> None:
        """Implemented by the backend."""
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def _paused_for_load(self) -> AsyncIterator[AsyncLLM]:
        """Hold the scheduler paused (the caller's pause, or one in "keep" mode taken here) while
        weights load, so that no engine step overlaps the load: the boundary between old- and
        new-version tokens is exact (see :mod:`rlinfer_vllm.versions`). KV caches are kept.
        With none of our requests in the engine, holding new ones back does the same without
        the two round trips of a pause (:mod:`rlinfer_vllm.load_gate`)."""
        llm = self._alive()
        async with self._pause_lock, self._gate.held() as idle:
            if self._user_pause is not None:
                yield llm
                return
            if idle:
                yield llm
                await self.rlinfer_reset_prefix_cache()  # a no-op unless requests ran since the last one
                return
            pause = getattr(llm.engine_core, "pause_scheduler_async", None)
            if pause is not None:  # AsyncLLM.pause_generation adds a 20 ms sleep
                await pause(mode="keep", clear_cache=False)
            else:
                await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                yield llm
                # nothing may reuse a prefix computed by the old weights once steps run again
                await self.rlinfer_reset_prefix_cache()
            finally:
                if not llm.errored:
                    await llm.resume_generation()

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names and shapes; dtypes: the checkpoint's under
        ``dtype="auto"``, else the served dtype."""
        return dict(self._specs)

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the worker, which loads it all-or-nothing."""
        try:
            started = time.perf_counter()
            prepared = await prepare_source(update.source)
            async with self._paused_for_load():
                worker = await send_source(update.source, prepared, self._rpc)
                assert self._versions is not None
                if update.version is not None:
                    self._versions.version = update.version
            logger.debug(
                "weight update: %.1f ms in the backend; worker: %s",
                (time.perf_counter() - started) * 1e3,
                {k: round(v * 1e3, 2) if k.endswith("_s") else v for k, v in worker.items()},
            )
        except (RLInferError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise WeightUpdateError(f"vLLM failed to load the update: {exc}") from exc

    @hookimpl
    async def rlinfer_weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums computed in the worker over what its kernels serve (see rlinfer_vllm.served)."""
        self._caps.require(Capability.WEIGHTS_CHECKSUM)
        tied = dict(self._info.tied_weights) if self._info is not None else {}
        return checksums(await self._rpc("rlinfer_weights_checksum", tied))

    async def quantized_check(self) -> dict[str, Any]:
        """On an engine started with ``quantization`` (``weights.quantized_reload``): the served
        weights against the last sent ones, computed in the worker (rlinfer_vllm.quantized):
        ``mismatched`` names, ``worst_ratio`` (<= 1: within FP8 rounding), ``quantized`` /
        ``exact`` counts. Not a hook: the GPU bench and the docs' recipe call it."""
        self._caps.require(Capability.WEIGHTS_QUANTIZED_RELOAD)
        report: dict[str, Any] = await self._rpc("rlinfer_quantized_check")
        return report

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have the worker join the trainer's group (blocks until every rank joined)."""
        check_group(self.platform, group)
        await self._rpc("rlinfer_join_group", attrs.asdict(group))


# --- shared with the server-mode backend (rlinfer_vllm.server_mode.weights) -------------------

#: ``rpc(method, *args)``: call ``RLInferWorkerExtension.<method>`` in the worker (bytes as bytes)
Rpc = Callable[..., Awaitable[Any]]


@attrs.frozen
class Prepared:
    """What an update needs before the scheduler pauses: CUDA tensors packed into buckets, or
    host tensors' shared-memory handles (none for the other sources)."""

    cuda_buckets: Sequence[Bucket] | None = None
    payload: bytes | None = None


async def prepare_source(source: WeightSource) -> Prepared:
    """Pack named tensors for the worker (off the event loop for host tensors)."""
    from rlinfer_core.transfer import ipc

    if not isinstance(source, NamedTensors):
        return Prepared()
    cuda_buckets = ipc.pack_cuda(source.tensors)
    if cuda_buckets is not None:
        return Prepared(cuda_buckets=cuda_buckets)
    payload = await asyncio.get_running_loop().run_in_executor(None, ipc.dumps, list(source.tensors))
    return Prepared(payload=payload)


async def send_source(source: WeightSource, prepared: Prepared, rpc: Rpc) -> Any:
    """Have the worker load ``source``; its timings."""
    # exhaustive: a new WeightSource type is a mypy error here until it is handled
    match source:
        case NamedTensors() if prepared.cuda_buckets is not None:
            return await send_buckets(prepared.cuda_buckets, rpc)
        case NamedTensors():
            return await rpc("rlinfer_load_ipc", prepared.payload)
        case Buckets():
            return await send_buckets(source.buckets, rpc)
        case CheckpointDir():
            return await rpc("rlinfer_load_dir", str(Path(source.path).resolve()))
        case BroadcastSource():
            return await rpc("rlinfer_load_broadcast", [(s.name, s.dtype, list(s.shape)) for s in source.specs])
        case _:
            assert_never(source)


async def send_buckets(buckets: Sequence[Bucket], rpc: Rpc) -> Any:
    """Buckets as their manifests plus shared-memory / CUDA-IPC handles of their data."""
    from rlinfer_core.transfer import ipc

    manifests = pickle.dumps([b.manifest for b in buckets])
    pairs = [(str(i), b.data) for i, b in enumerate(buckets)]
    payload = await asyncio.get_running_loop().run_in_executor(None, ipc.dumps, pairs)
    return await rpc("rlinfer_load_buckets", manifests, payload)


def checksums(rows: Sequence[Sequence[Any]]) -> dict[str, WeightChecksum]:
    """The worker's ``rlinfer_weights_checksum`` rows as checksums by name."""
    return {name: WeightChecksum(dtype, tuple(shape), digest) for name, dtype, shape, digest in rows}


def check_group(platform: Platform, group: BroadcastGroup) -> None:
    """InvalidRequest for a group this platform's worker cannot join."""
    if platform == "cpu" and group.backend != "gloo":
        raise InvalidRequest("backend", "vLLM on CPU joins gloo groups only")
