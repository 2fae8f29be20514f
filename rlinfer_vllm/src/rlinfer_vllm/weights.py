"""The vLLM backend's weight hooks (a mixin of :class:`rlinfer_vllm.backend.VllmBackend`):
updates over every transport, checksums, the broadcast group, for both flavours. Loading happens
in the worker (:mod:`rlinfer_vllm.worker`), reached by the transport's ``rpc``.

No engine step overlaps a load (the caller's pause, a load at the engine core's step boundary,
or a pause in "keep" mode taken here: :meth:`WeightHooks._loading`), and the engine's version
label switches between the last step before it and the first after: every token computed after
the load carries the new version (:mod:`rlinfer_vllm.versions`, :mod:`rlinfer_vllm.transport.stream_versions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pickle
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
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

if TYPE_CHECKING:
    from rlinfer_core.transfer.arena import PackArena
    from rlinfer_vllm.load_gate import LoadGate
    from rlinfer_vllm.transport import Transport

logger = logging.getLogger("rlinfer_vllm.backend")


#: how long an update holds new requests back for the admitted ones to finish prefilling, so
#: that loading needs no prefix-cache reset (a reset preempts every running request: on an H100
#: under 128 streams it stalled generation 80-330 ms per update)
PREFILL_SETTLE_S = 0.25


@contextlib.contextmanager
def failures_typed(what: str) -> Iterator[None]:
    """An engine failure inside becomes WeightUpdateError naming ``what`` (rlinfer's other errors
    and cancellation pass; a server's 5xx is the engine's failure)."""
    from rlinfer_core.server_http import ServerError

    try:
        yield
    except ServerError as exc:
        raise WeightUpdateError(f"vLLM failed to {what}: {exc}") from exc
    except RLInferError:
        raise
    except Exception as exc:
        raise WeightUpdateError(f"vLLM failed to {what}: {exc}") from exc


class WeightHooks:
    """Weight-sync hooks of :class:`rlinfer_vllm.backend.VllmBackend`."""

    config: EngineConfig
    platform: Platform
    _caps: Capabilities
    _specs: dict[str, TensorSpec]
    _info: ModelInfo | None
    _pause_lock: asyncio.Lock
    _user_pause: PauseMode | None
    _gate: LoadGate
    #: the buffers CUDA tensors are packed into for the worker (:func:`prepare_source`)
    _ipc_arena: PackArena

    def _alive(self) -> Transport:
        raise NotImplementedError

    async def rlinfer_reset_prefix_cache(self) -> None:
        """Implemented by the backend."""
        raise NotImplementedError

    #: the facade skips its prefix-cache reset after an update: :meth:`_after_load` does what is needed
    update_invalidates_prefixes = True
    #: the facade leaves the values of CUDA tensors to :func:`prepare_source`'s packing
    checks_cuda_tensor_values = True

    @contextlib.asynccontextmanager
    async def _loading(self, version: int | None) -> AsyncIterator[Rpc]:
        """The ``rpc`` to load an update with, and what surrounds it: no engine step overlaps the
        load, so the boundary between old- and new-version tokens is exact, and the outputs of
        every step after it are labelled ``version`` (None: a load that starts no new version).
        KV caches are kept. Cheapest first:

        - the caller's pause holds the scheduler, or none of our requests is in the engine (a
          gated transport: holding new ones back is enough, :mod:`rlinfer_vllm.load_gate`): the
          worker call as it is;
        - the engine core loads between two of its steps (in process,
          :mod:`rlinfer_vllm.engine_core.step_boundary`): one call, no round trip between
          pause, load and resume;
        - else the scheduler is paused in "keep" mode around the load (three round trips).
        """
        transport = self._alive()
        async with self._pause_lock, self._gate.held() as idle:
            if self._user_pause is not None or (idle and transport.gated):
                yield transport.rpc
                await self._after_load(transport, version)
                return
            if version is not None and transport.salted:
                # generation goes on meanwhile; a request still prefilling under the old salt
                # would make the load reset the cache, preempting every running request
                await transport.settle_prefills(PREFILL_SETTLE_S)
            if version is not None and transport.loads_at_step_boundary:
                yield functools.partial(transport.rpc_at_step_boundary, version=version)
                return
            await transport.pause_for_load()
            try:
                yield transport.rpc
                await self._after_load(transport, version)  # before any step runs again
            finally:
                await transport.resume_after_load()

    async def _after_load(self, transport: Transport, version: int | None) -> None:
        """Label later outputs ``version``, and leave no prefix computed by the old weights to a
        request of the new version.

        Salted requests (:mod:`rlinfer_vllm.versions`) need no prefix-cache reset: the new
        version's salt reaches none of the old blocks, and running requests keep their KV. Unless
        a request admitted under the old salt may not have prefilled yet (it would prefill with
        the new weights and could read old blocks): then, as on a transport that cannot salt,
        vLLM's cache is reset (running requests recomputed if they hold blocks). Image embeddings
        are keyed by the image alone, so the encoder cache is always dropped."""
        if version is not None:
            await transport.label_version(version)
        if transport.salted and version is not None and not transport.prefill_pending():
            logger.debug("weight update: prefix cache kept (requests are salted by version)")
            if transport.multimodal:
                await transport.reset_encoder_cache()
            return
        logger.debug("weight update: prefix cache reset (salted: %s)", transport.salted)
        await self.rlinfer_reset_prefix_cache()

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names and shapes; dtypes: the checkpoint's under
        ``dtype="auto"``, else the served dtype."""
        return dict(self._specs)

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the worker, which loads it all-or-nothing."""
        with failures_typed("load the update"):
            started = time.perf_counter()
            prepared = await prepare_source(update.source, engine_gpus(self.config), self._ipc_arena)
            pack_s = time.perf_counter() - started
            async with self._loading(update.version) as rpc:
                with self._ipc_arena.sending():
                    worker = await send_source(update.source, prepared, rpc)
            logger.debug(
                "weight update: %.1f ms in the backend; worker: %s",
                (time.perf_counter() - started) * 1e3,
                {k: round(v * 1e3, 2) if k.endswith("_s") else v for k, v in {**worker, "pack_s": pack_s}.items()}
                if isinstance(worker, Mapping)
                else worker,
            )

    @hookimpl
    async def rlinfer_weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums computed in the worker over what its kernels serve (see rlinfer_vllm.worker.served)."""
        self._caps.require(Capability.WEIGHTS_CHECKSUM)
        tied = dict(self._info.tied_weights) if self._info is not None else {}
        return checksums(await self._alive().rpc("rlinfer_weights_checksum", tied))

    async def quantized_check(self) -> dict[str, Any]:
        """On an engine started with ``quantization`` (``weights.quantized_reload``): the served
        weights against the last sent ones, computed in the worker (rlinfer_vllm.worker.quantized):
        ``mismatched`` names, ``worst_ratio`` (<= 1: within FP8 rounding), ``quantized`` /
        ``exact`` counts. Not a hook: the GPU bench and the docs' recipe call it."""
        self._caps.require(Capability.WEIGHTS_QUANTIZED_RELOAD)
        report: dict[str, Any] = await self._alive().rpc("rlinfer_quantized_check")
        return report

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have the worker join the trainer's group (returns once every rank joined)."""
        from rlinfer_core.server_http import ServerError

        check_group(self.platform, group)
        try:
            await self._alive().rpc("rlinfer_join_group", attrs.asdict(group))
        except ServerError as exc:
            raise WeightUpdateError(f"the vLLM worker could not join the broadcast group: {exc}") from exc


#: ``rpc(method, *args)``: call ``RLInferWorkerExtension.<method>`` in the worker (bytes as bytes)
Rpc = Callable[..., Awaitable[Any]]


@attrs.frozen
class Prepared:
    """What an update needs before the scheduler pauses: CUDA tensors packed into buckets, or
    host tensors' shared-memory handles (none for the other sources)."""

    cuda_buckets: Sequence[Bucket] | None = None
    #: the worker keeps ``cuda_buckets`` mapped until the next update (the arena reuses them)
    keep_mapped: bool = False
    #: a Buckets source's buckets, moved onto a GPU the engine sees where needed
    buckets: Sequence[Bucket] | None = None
    payload: bytes | None = None


async def prepare_source(source: WeightSource, engine_gpus: int, arena: PackArena) -> Prepared:
    """Pack named tensors for the worker (off the event loop for host tensors); CUDA tensors
    into ``arena``'s buffers, their values checked there (WeightUpdateError for NaN or inf).

    vLLM starts its engine processes seeing only the engine's GPUs (this process's first
    ``engine_gpus``): CUDA tensors on another GPU are first copied onto GPU 0, since a CUDA IPC
    handle to them cannot be opened there.
    """
    from rlinfer_core.transfer import ipc

    if isinstance(source, Buckets):
        return Prepared(buckets=ipc.onto_visible_gpus(source.buckets, engine_gpus))
    if not isinstance(source, NamedTensors):
        return Prepared()
    # The arena hands the same buffers to every update of one layout, so the worker maps nothing
    # new (it keeps what it mapped: ipc.keep_mapped). Reuse is safe because updates and stagings
    # are serialized (the facade's weight lock, _pause_lock) and every worker load and staging
    # copies out of the buffers and synchronizes before its call returns; a call that does not
    # return makes the arena forget them (PackArena.sending).
    cuda_buckets = ipc.pack_cuda(source.tensors, visible_gpus=engine_gpus, arena=arena, check_values=True)
    if cuda_buckets is not None:
        return Prepared(cuda_buckets=cuda_buckets, keep_mapped=arena.keep)
    payload = await asyncio.get_running_loop().run_in_executor(None, ipc.dumps, list(source.tensors))
    return Prepared(payload=payload)


async def send_source(source: WeightSource, prepared: Prepared, rpc: Rpc) -> Any:
    """Have the worker load ``source``; its timings."""
    # exhaustive: a new WeightSource type is a mypy error here until it is handled
    match source:
        case NamedTensors() if prepared.cuda_buckets is not None:
            return await send_buckets(prepared.cuda_buckets, rpc, prepared.keep_mapped)
        case NamedTensors():
            return await rpc("rlinfer_load_ipc", prepared.payload)
        case Buckets():
            return await send_buckets(prepared.buckets or source.buckets, rpc)
        case CheckpointDir():
            return await rpc("rlinfer_load_dir", str(Path(source.path).resolve()))
        case BroadcastSource():
            return await rpc("rlinfer_load_broadcast", [(s.name, s.dtype, list(s.shape)) for s in source.specs])
        case _:
            assert_never(source)


async def send_buckets(buckets: Sequence[Bucket], rpc: Rpc, keep_mapped: bool = False) -> Any:
    """Buckets as their manifests plus shared-memory / CUDA-IPC handles of their data;
    ``keep_mapped``: the worker keeps CUDA ones mapped until the next update (see ipc.keep_mapped)."""
    from rlinfer_core.transfer import ipc

    manifests = pickle.dumps([b.manifest for b in buckets])
    pairs = [(str(i), b.data) for i, b in enumerate(buckets)]
    if ipc.all_cuda(pairs):  # handles only: no copy into shared memory to keep off the event loop
        payload = ipc.dumps(pairs)
    else:
        payload = await asyncio.get_running_loop().run_in_executor(None, ipc.dumps, pairs)
    return await rpc("rlinfer_load_buckets", manifests, payload, keep_mapped)


def checksums(rows: Sequence[Sequence[Any]]) -> dict[str, WeightChecksum]:
    """The worker's ``rlinfer_weights_checksum`` rows as checksums by name."""
    return {name: WeightChecksum(dtype, tuple(shape), digest) for name, dtype, shape, digest in rows}


def check_group(platform: Platform, group: BroadcastGroup) -> None:
    """InvalidRequest for a group this platform's worker cannot join."""
    if platform == "cpu" and group.backend != "gloo":
        raise InvalidRequest("backend", "vLLM on CPU joins gloo groups only")


def engine_gpus(config: EngineConfig) -> int:
    """How many of this process's GPUs the engine's processes see (its first ones)."""
    return config.tensor_parallel_size * config.pipeline_parallel_size
