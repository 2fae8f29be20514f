"""The vLLM backend's weight hooks (a mixin): updates over every transport, checksums, the
broadcast group. Loading happens in the worker (:mod:`rlinfer_vllm.worker`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import time
from collections.abc import AsyncIterator, Mapping, Sequence
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
    WeightUpdate,
)
from rlinfer_vllm.capabilities import Platform
from rlinfer_vllm.versions import TokenVersions

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

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
        new-version tokens is exact (see :mod:`rlinfer_vllm.versions`). KV caches are kept."""
        llm = self._alive()
        async with self._pause_lock:
            if self._user_pause is not None:
                yield llm
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
        from rlinfer_core.transfer import ipc

        source = update.source
        loop = asyncio.get_running_loop()
        try:
            started = time.perf_counter()
            cuda_buckets = ipc.pack_cuda(source.tensors) if isinstance(source, NamedTensors) else None
            payload = None
            if cuda_buckets is None and isinstance(source, NamedTensors):
                payload = await loop.run_in_executor(None, ipc.dumps, list(source.tensors))
            async with self._paused_for_load():
                # exhaustive: a new WeightSource type is a mypy error here until it is handled
                match source:
                    case NamedTensors() if cuda_buckets is not None:
                        worker = await self._send_buckets(cuda_buckets)
                    case NamedTensors():
                        worker = await self._rpc("rlinfer_load_ipc", payload)
                    case Buckets():
                        worker = await self._send_buckets(source.buckets)
                    case CheckpointDir():
                        worker = await self._rpc("rlinfer_load_dir", str(Path(source.path).resolve()))
                    case BroadcastSource():
                        specs = [(s.name, s.dtype, list(s.shape)) for s in source.specs]
                        worker = await self._rpc("rlinfer_load_broadcast", specs)
                    case _:
                        assert_never(source)
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

    async def _send_buckets(self, buckets: Sequence[Bucket]) -> dict[str, float]:
        from rlinfer_core.transfer import ipc

        manifests = pickle.dumps([b.manifest for b in buckets])
        pairs = [(str(i), b.data) for i, b in enumerate(buckets)]
        payload = await asyncio.get_running_loop().run_in_executor(None, ipc.dumps, pairs)
        timings: dict[str, float] = await self._rpc("rlinfer_load_buckets", manifests, payload)
        return timings

    @hookimpl
    async def rlinfer_weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums computed in the worker over what its kernels serve (see rlinfer_vllm.served)."""
        self._caps.require(Capability.WEIGHTS_CHECKSUM)
        tied = dict(self._info.tied_weights) if self._info is not None else {}
        rows = await self._rpc("rlinfer_weights_checksum", tied)
        return {name: WeightChecksum(dtype, tuple(shape), digest) for name, dtype, shape, digest in rows}

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have the worker join the trainer's group (blocks until every rank joined)."""
        if self.platform == "cpu" and group.backend != "gloo":
            raise InvalidRequest("backend", "vLLM on CPU joins gloo groups only")
        await self._rpc("rlinfer_join_group", attrs.asdict(group))
