"""Weight hooks over HTTP: rlinfer's scheduler-side loader through SGLang's own endpoints.

Every transport goes as in-process (:mod:`rlinfer_sglang.weight_channel`): SGLang's
``/begin_weight_update``, ``/update_weights_from_tensor`` with ``load_format`` = rlinfer's custom
loader (:mod:`rlinfer_sglang.scheduler_side`; the serialized ``(name, tensor)`` pairs travel
base64 in the JSON body, tensors as shared-memory / CUDA-IPC handles by
:func:`rlinfer_core.transfer.ipc.dumps`), ``/end_weight_update``.
An SGLang without ``/begin_weight_update`` (0.5.16, found at start by :func:`has_begin_end`) gets
the in-process backend's semantics there: no begin/end, the cache flushed through ``/flush_cache``
rather than inside the update (that SGLang's scheduler dies when its post-update flush fails), and
an update with requests running waits for them (new ones wait at the gate), since that SGLang
flushes only when no request is pending, a retracted one included.
The loader reads and checks everything before loading and writes its outcome to a file on this
host, which the backend reads (so these transports need the server on this host).

Weight versions: the backend's gate holds new requests, requests in flight are retracted
(``/pause_generation`` "retract", unless the caller paused already) for the load, and after a
successful load ``/update_weight_version`` sets SGLang's label to the new version before anything
runs again: SGLang records every live request's output length at that change and reports exact
spans per token (:func:`rlinfer_sglang.server_mode.convert.expand_versions`). Streams, whose
chunks carry no spans until the last, use the loader's own record of those lengths.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import attrs

from rlinfer_core.errors import InvalidRequest, RLInferError, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.server_http import ServerClient, ServerError
from rlinfer_core.types import Capability
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
from rlinfer_sglang.config import WEIGHT_LOADER
from rlinfer_sglang.server_mode import convert as wire
from rlinfer_sglang.server_mode.inflight import InFlight

#: how long a flush on an SGLang without /begin_weight_update waits for running requests (the
#: facade gives ``reset_prefix_cache`` 60 s)
FLUSH_WAIT_S = 50.0
#: how long the flush right after an idle update waits for the scheduler's last batch to clear
IDLE_FLUSH_WAIT_S = 5.0


async def has_begin_end(http: ServerClient) -> bool:
    """Whether the server has ``/begin_weight_update`` (SGLang >= 0.5.2x): asked without side
    effects, as a GET that the POST-only route refuses with 405; 404 means it has no such route."""
    status, _ = await http.request("GET", "/begin_weight_update")
    return status != 404


if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum

logger = logging.getLogger(__name__)


class ServerWeights(InFlight):
    """Weight specs, updates over every transport, broadcast groups, checksums, prefix cache."""

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names, in the engine's dtype, with their shapes."""
        return dict(self._specs)

    async def _control(self, http: ServerClient, path: str, body: Any) -> tuple[bool, str]:
        """SGLang's ``{"success", "message"}`` control endpoints (400 = the operation failed)."""
        status, answer = await http.request("POST", path, body)
        answer = answer if isinstance(answer, Mapping) else {"message": str(answer)}
        if status == 422:  # pydantic: a malformed body (a bug here, or another SGLang version)
            raise ServerError("SGLang", path, status, str(answer))
        return bool(answer.get("success", status < 300)), str(answer.get("message", ""))

    async def _scheduler_op(
        self, control: dict[str, Any], tensors: Sequence[tuple[str, Any]] = (), *, flush: bool
    ) -> dict[str, Any]:
        """Run rlinfer's scheduler-side loader once on every TP rank; raise on any failure;
        return TP rank 0's outcome."""
        from rlinfer_core.transfer import ipc
        from rlinfer_sglang.scheduler_side import encode_control

        http = self._alive()
        result = self._result_dir / uuid.uuid4().hex
        pairs = [encode_control({**control, "result": str(result)}), *tensors]
        loop = asyncio.get_running_loop()
        # file_system handles (names): the scheduler is no child of this process, so it cannot
        # fetch file descriptors from it (multiprocessing's resource sharer checks the authkey)
        payload = await loop.run_in_executor(None, ipc.dumps, pairs)
        encoded = base64.b64encode(payload).decode("ascii")
        deferred = flush and self._flush_needs_idle
        if deferred:
            # this SGLang's scheduler asserts that its post-update flush succeeded (and dies when a
            # request is pending): flush through /flush_cache after the load instead
            flush = False
        body = {
            # one payload serves every TP rank: shared-memory names open any number of times,
            # unlike file descriptors (tests/backends/sglang/test_sglang_tp2_cpu.py, TP=2)
            "serialized_named_tensors": [encoded] * self._tp_size,
            "load_format": WEIGHT_LOADER,
            "flush_cache": flush,
            "abort_all_requests": False,
        }
        end_ok, end_message = True, ""
        if self._begin_end:
            ok, message = await self._control(http, "/begin_weight_update", {})
            if not ok:
                raise WeightUpdateError(f"SGLang refused to open a weight update: {message}")
        try:
            ok, message = await self._control(http, "/update_weights_from_tensor", body)
        finally:
            if self._begin_end:
                end_ok, end_message = await asyncio.shield(self._control(http, "/end_weight_update", {}))
        outcomes = [self._outcome(result, rank) for rank in range(self._tp_size)]
        logger.debug("weight op %s: scheduler outcomes %s", control["op"], outcomes)
        failed = [o for o in outcomes if not o.get("ok")]
        if failed:
            problems = tuple(str(o.get("error")) for o in failed)
            if any(o.get("loaded") for o in failed):
                raise WeightUpdateError(
                    "SGLang failed while loading; the engine may hold a partial update: reload a full checkpoint",
                    problems,
                )
            raise WeightUpdateError(f"{control['op']} update rejected before loading", problems)
        if not ok and flush:
            self._cache_dirty = True  # loaded, but the flush was refused (requests held): at reset
        elif not ok:
            raise WeightUpdateError(f"SGLang failed the update: {message}")
        elif flush:
            self._cache_dirty = False
        elif deferred:
            self._cache_dirty = True  # flushed after the load (rlinfer_update_weights) or at reset
        if not end_ok:
            raise WeightUpdateError(f"SGLang failed to finish the weight update: {end_message}")
        return outcomes[0]

    def _outcome(self, result: Path, rank: int) -> dict[str, Any]:
        path = Path(f"{result}.{rank}")
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._alive()
            return {"ok": False, "loaded": True, "error": f"TP rank {rank} reported no outcome"}
        finally:
            path.unlink(missing_ok=True)
        return data

    @asynccontextmanager
    async def _quiet_scheduler(self) -> AsyncIterator[None]:
        """Nothing runs in the scheduler for the block: new requests wait at the gate, requests in
        flight are retracted (they keep their tokens) unless SGLang is paused already."""
        async with self._gate_closed():
            hold = self._active > 0 and not self._sglang_paused and not self._memory_paused
            if hold:
                await self._sglang_pause("retract")
            try:
                yield
            finally:
                if hold:
                    await asyncio.shield(self._sglang_continue())

    @asynccontextmanager
    async def _idle_scheduler(self) -> AsyncIterator[None]:
        """For an SGLang without /begin_weight_update: new requests wait at the gate and the block
        runs once the requests in flight finished (bounded by ``request_timeout_s``; nothing is
        loaded when they do not finish in time)."""
        async with self._gate_closed():
            timeout = self.config.request_timeout_s
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=timeout)
            except TimeoutError as exc:
                self._alive()
                raise WeightUpdateError(
                    f"the requests in flight did not finish within {timeout:.0f} s; nothing was loaded "
                    "(this SGLang loads only between requests: pause(abort) first)"
                ) from exc
            yield

    def _quiet(self) -> Any:
        """How nothing runs during an update: requests retracted for it, or (an SGLang without
        /begin_weight_update, whose cache flush fails while a retracted request is pending) the
        update waits for them, as SGLang itself and the in-process backend do there."""
        running = self._active > 0 and not self._sglang_paused and not self._memory_paused
        return self._idle_scheduler() if running and self._flush_needs_idle else self._quiet_scheduler()

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the scheduler, which checks all of it, then loads; then
        label the new version while nothing runs."""
        version = update.version if update.version is not None else self._versions.current + 1
        async with self._pause_lock, self._quiet():
            outcome = await self._load(update)
            ok, message = await self._control(
                self._alive(),
                "/update_weight_version",
                {"new_version": wire.label(version), "abort_all_requests": False},
            )
            if not ok:
                raise WeightUpdateError(f"SGLang loaded the update but refused its version label: {message}")
            in_flight = [r for rids in self._rids.values() for r in rids]
            dispatched = {r for r in in_flight if self._received.get(r, 0) > 0}
            lengths = outcome.get("lengths")
            if lengths is None:
                logger.warning("the scheduler did not report request lengths; streamed tokens keep the old version")
                lengths, dispatched = {}, set(in_flight)
            self._versions.loaded(version, in_flight, dispatched, lengths)
            if self._cache_dirty and self._flush_needs_idle and self._active == 0:
                # flushed while new requests still wait at the gate (the facade's reset, after
                # it opens, could find requests pending, which this SGLang does not flush under)
                await self._flush(self._alive(), IDLE_FLUSH_WAIT_S)

    async def _load(self, update: WeightUpdate) -> dict[str, Any]:
        from rlinfer_core.transfer import ipc

        source = update.source
        cuda_buckets = ipc.pack_cuda(source.tensors) if isinstance(source, NamedTensors) else None
        # exhaustive: a new WeightSource type is a mypy error here until it is handled
        match source:
            case NamedTensors() if cuda_buckets is not None:
                return await self._send_buckets(cuda_buckets)
            case NamedTensors():
                return await self._scheduler_op({"op": "tensors"}, list(source.tensors), flush=True)
            case Buckets():
                return await self._send_buckets(source.buckets)
            case CheckpointDir():
                return await self._scheduler_op({"op": "disk", "path": str(Path(source.path).resolve())}, flush=True)
            case BroadcastSource():
                specs = [(s.name, s.dtype, list(s.shape)) for s in source.specs]
                control = {"op": "broadcast", "group_name": self._group_name, "specs": specs}
                return await self._scheduler_op(control, flush=True)
            case _:
                assert_never(source)

    async def _send_buckets(self, buckets: Sequence[Bucket]) -> dict[str, Any]:
        manifests = [attrs.asdict(b.manifest) for b in buckets]
        pairs = [(str(i), b.data) for i, b in enumerate(buckets)]
        return await self._scheduler_op({"op": "buckets", "manifests": manifests}, pairs, flush=True)

    @hookimpl
    async def rlinfer_weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums computed in the scheduler over the served parameters, by HF name."""
        from rlinfer_sglang.scheduler_side import served_checksums

        self._caps.require(Capability.WEIGHTS_CHECKSUM)
        specs = [[name, list(spec.shape)] for name, spec in self._specs.items()]
        if "lm_head.weight" not in self._specs and "model.embed_tokens.weight" in self._specs:
            specs.append(["lm_head.weight", list(self._specs["model.embed_tokens.weight"].shape)])
        outcome = await self._scheduler_op({"op": "checksum", "specs": specs}, flush=False)
        return served_checksums(outcome)

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have every scheduler rank join the trainer's group (blocks until all ranks joined)."""
        if self.platform == "cpu" and group.backend != "gloo":
            raise InvalidRequest("backend", "SGLang on CPU joins gloo groups only")
        if group.rank_offset + self._tp_size > group.world_size:
            raise InvalidRequest(
                "world_size",
                f"must hold rank_offset ({group.rank_offset}) + {self._tp_size} engine ranks, got {group.world_size}",
            )
        try:
            await self._scheduler_op({"op": "join", "group": attrs.asdict(group)}, flush=False)
        except WeightUpdateError as exc:
            raise RLInferError(f"the SGLang scheduler could not join the weight group: {exc}") from exc
        self._group_name = group.group_name

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """``/flush_cache``; running requests are retracted (recomputed) if they hold the cache."""
        http = self._alive()
        if not self._cache_dirty:
            return
        if await self._flush(http):
            return
        if self._sglang_paused or self._memory_paused:
            raise RLInferError("SGLang refused to flush its cache while paused")
        if self._flush_needs_idle:
            # this SGLang does not flush while a retracted request is pending: new requests wait
            # at the gate and SGLang flushes once the running ones finished (its deferred flush)
            async with self._gate_closed():
                if not await self._flush(http, FLUSH_WAIT_S):
                    raise RLInferError(
                        f"SGLang refused to flush its cache: requests still ran after {FLUSH_WAIT_S:.0f} s"
                    )
            return
        await self._sglang_pause("retract")
        try:
            flushed = await self._flush(http)
        finally:
            await asyncio.shield(self._sglang_continue())
        if not flushed:
            raise RLInferError("SGLang refused to flush its cache")

    async def _flush(self, http: ServerClient, wait_s: float = 0.0) -> bool:
        """``/flush_cache``; ``wait_s`` > 0: SGLang flushes as soon as it is idle, within that time."""
        if wait_s > 0:
            params = {"timeout": wait_s}
            status, _ = await http.request("POST", "/flush_cache", params=params, timeout_s=wait_s + 10)
        else:
            status, _ = await http.request("POST", "/flush_cache")
        if status == 200:
            self._cache_dirty = False
        return status == 200

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """SGLang's own ``/update_weights_from_disk``, no rlinfer validation."""
        http = self._alive()
        # a checkpoint on disk holds real weights, also on a server started with load_format=dummy
        body = {"model_path": str(Path(path).resolve()), "flush_cache": False, "load_format": "auto"}
        ok, message = await self._control(http, "/update_weights_from_disk", body)
        if not ok:
            raise WeightUpdateError(f"SGLang update_weights_from_disk failed: {message}")
        self._cache_dirty = True
        await self.rlinfer_reset_prefix_cache()
