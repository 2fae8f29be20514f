"""Weight sync of the vLLM backend, for both flavours: :class:`WeightSync` packs and sends every
weight source to the worker (:mod:`rlinfer_vllm.worker`, reached by the transport's ``rpc``),
loads updates (sequenced around engine steps by :class:`rlinfer_vllm.load_gate.LoadSequencing`),
reads the served checksums and joins the trainer's broadcast group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import attrs

from rlinfer_core.checksum import WeightChecksum
from rlinfer_core.errors import InvalidRequest, RLInferError, WeightUpdateError
from rlinfer_core.transfer.arena import engine_arena
from rlinfer_core.types import Capabilities, Capability, EngineConfig
from rlinfer_core.weights import (
    BroadcastGroup,
    BroadcastSource,
    Bucket,
    Buckets,
    CheckpointDir,
    NamedTensors,
    WeightSource,
    WeightUpdate,
)
from rlinfer_vllm.capabilities import Platform

if TYPE_CHECKING:
    from rlinfer_vllm.load_gate import LoadSequencing, Rpc
    from rlinfer_vllm.transport import Transport

logger = logging.getLogger("rlinfer_vllm.backend")


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


class WeightSync:
    """Weight updates (and the sending of stagings), served checksums and the broadcast group."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        alive: Callable[[], Transport],
        capabilities: Callable[[], Capabilities],
        sequencing: LoadSequencing,
    ) -> None:
        self._engine_gpus = config.tensor_parallel_size * config.pipeline_parallel_size  #: GPUs the engine sees
        self._platform = platform
        self._alive = alive  #: the live transport (EngineDead once shut down)
        self._capabilities = capabilities  #: the backend's current ones (refined at start)
        self._sequencing = sequencing
        self._arena = engine_arena()  #: the buffers CUDA tensors are packed into, reused across updates

    async def prepare(self, source: WeightSource) -> Prepared:
        """Pack named tensors for the worker (off the event loop for host tensors); CUDA tensors
        into the arena's buffers, their values checked there (WeightUpdateError for NaN or inf).

        vLLM starts its engine processes seeing only the engine's GPUs (this process's first
        ``engine_gpus``): CUDA tensors on another GPU are first copied onto GPU 0, since a CUDA IPC
        handle to them cannot be opened there.
        """
        from rlinfer_core.transfer import ipc

        if isinstance(source, Buckets):
            return Prepared(buckets=ipc.onto_visible_gpus(source.buckets, self._engine_gpus))
        if not isinstance(source, NamedTensors):
            return Prepared()
        # The arena hands the same buffers to every update of one layout, so the worker maps nothing
        # new (it keeps what it mapped: ipc.keep_mapped). Reuse is safe because updates and stagings
        # are serialized (the facade's weight lock, LoadSequencing's lock) and every worker load and
        # staging copies out of the buffers and synchronizes before its call returns; a call that
        # does not return makes the arena forget them (PackArena.sending).
        arena, gpus = self._arena, self._engine_gpus
        cuda_buckets = ipc.pack_cuda(source.tensors, visible_gpus=gpus, arena=arena, check_values=True)
        if cuda_buckets is not None:
            return Prepared(cuda_buckets=cuda_buckets, keep_mapped=arena.keep)
        payload = await asyncio.get_running_loop().run_in_executor(None, ipc.dumps, list(source.tensors))
        return Prepared(payload=payload)

    async def send(self, source: WeightSource, prepared: Prepared, rpc: Rpc) -> Any:
        """Have the worker take ``source`` through ``rpc`` (see :func:`send_source`); its timings."""
        with self._arena.sending():
            return await send_source(source, prepared, rpc)

    async def close(self, release_mapped: Callable[[], Awaitable[object]]) -> None:
        """Free the buffers (``release_mapped``: the worker's call that unmaps them)."""
        await self._arena.close(release_mapped)

    async def update(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the worker, which loads it all-or-nothing."""
        with failures_typed("load the update"):
            started = time.perf_counter()
            prepared = await self.prepare(update.source)
            pack_s = time.perf_counter() - started
            async with self._sequencing.loading(update.version) as rpc:
                worker = await self.send(update.source, prepared, rpc)
            logger.debug(
                "weight update: %.1f ms in the backend; worker: %s",
                (time.perf_counter() - started) * 1e3,
                {k: round(v * 1e3, 2) if k.endswith("_s") else v for k, v in {**worker, "pack_s": pack_s}.items()}
                if isinstance(worker, Mapping)
                else worker,
            )

    async def checksums(self, tied_weights: Mapping[str, str]) -> dict[str, WeightChecksum]:
        """Checksums computed in the worker over what its kernels serve (see rlinfer_vllm.worker.served)."""
        self._capabilities().require(Capability.WEIGHTS_CHECKSUM)
        rows = await self._alive().rpc("rlinfer_weights_checksum", dict(tied_weights))
        return {name: WeightChecksum(dtype, tuple(shape), digest) for name, dtype, shape, digest in rows}

    async def quantized_check(self) -> dict[str, Any]:
        """On an engine started with ``quantization`` (``weights.quantized_reload``): the served
        weights against the last sent ones, computed in the worker (rlinfer_vllm.worker.quantized):
        ``mismatched`` names, ``worst_ratio`` (<= 1: within FP8 rounding), ``quantized`` /
        ``exact`` counts."""
        self._capabilities().require(Capability.WEIGHTS_QUANTIZED_RELOAD)
        report: dict[str, Any] = await self._alive().rpc("rlinfer_quantized_check")
        return report

    async def join_broadcast(self, group: BroadcastGroup) -> None:
        """Have the worker join the trainer's group (returns once every rank joined)."""
        from rlinfer_core.server_http import ServerError

        if self._platform == "cpu" and group.backend != "gloo":
            raise InvalidRequest("backend", "vLLM on CPU joins gloo groups only")
        try:
            await self._alive().rpc("rlinfer_join_group", attrs.asdict(group))
        except ServerError as exc:
            raise WeightUpdateError(f"the vLLM worker could not join the broadcast group: {exc}") from exc


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
