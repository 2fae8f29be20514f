"""The weight channel to SGLang's scheduler: updates, broadcast groups, the prefix cache.

Weight updates go through SGLang's ``update_weights_from_tensor`` (inside
``begin_weight_update``/``end_weight_update``) with rlinfer's scheduler-side loader
(:mod:`rlinfer_sglang.scheduler_side`), which reads and checks everything before loading.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import attrs

from rlinfer_core.errors import InvalidRequest, RLInferError, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
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
from rlinfer_sglang.base import BackendBase
from rlinfer_sglang.config import WEIGHT_LOADER

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum

logger = logging.getLogger(__name__)


class WeightChannel(BackendBase):
    """Weight specs, updates over every transport, broadcast groups and prefix-cache reset."""

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names, in the engine's dtype, with their shapes."""
        return dict(self._specs)

    async def _scheduler_op(
        self,
        control: dict[str, Any],
        tensors: Sequence[tuple[str, Any]] = (),
        *,
        flush: bool,
        before_send: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Run rlinfer's scheduler-side loader once on every TP rank; raise on any failure.

        Returns TP rank 0's outcome. ``before_send`` runs right before the update message is
        handed to the tokenizer manager, in the same task (no other task runs in between).
        """
        from sglang.srt.managers import io_struct
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        from rlinfer_sglang.scheduler_side import encode_control

        tm = self._alive()
        result = self._result_dir / uuid.uuid4().hex
        pairs = [encode_control({**control, "result": str(result)}), *tensors]
        loop = asyncio.get_running_loop()
        # one serialization per TP rank: a CPU tensor travels as a file descriptor that
        # multiprocessing's resource sharer hands out once, so ranks cannot share one payload
        payloads = [
            await loop.run_in_executor(None, MultiprocessingSerializer.serialize, pairs) for _ in range(self._tp_size)
        ]
        # SGLang >= 0.5.2x wraps tensor updates in begin/end_weight_update; 0.5.16 has neither.
        begin = getattr(io_struct, "BeginWeightUpdateReqInput", None)
        end = getattr(io_struct, "EndWeightUpdateReqInput", None)
        flush = flush and self._cache_stale()  # else nothing cached that the old weights computed
        deferred = flush and begin is None
        if deferred:
            # 0.5.16's scheduler asserts that the post-update flush succeeded, and dies when a
            # request is held by pause(keep) (measured on an H100): flush at the facade's reset
            flush = False
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=WEIGHT_LOADER, flush_cache=flush
        )
        if begin is not None:
            ok, message = await self._guard(tm.begin_weight_update(begin(), None))
            if not ok:
                raise WeightUpdateError(f"SGLang refused to open a weight update: {message}")
        end_ok, end_message = True, ""
        try:
            ok, message = (await self._guard(self._send_update(tm, req, before_send)))[:2]
        finally:
            if end is not None:
                end_ok, end_message = await self._guard(tm.end_weight_update(end(), None))
        outcomes = [self._outcome(result, rank) for rank in range(self._tp_size)]
        logger.debug("weight op %s: scheduler outcomes %s", control["op"], outcomes)
        failed = [o for o in outcomes if not o.get("ok")]
        if failed:
            partial = any(o.get("loaded") for o in failed)
            problems = tuple(str(o.get("error")) for o in failed)
            if partial:
                raise WeightUpdateError(
                    "SGLang failed while loading; the engine may hold a partial update: reload a full checkpoint",
                    problems,
                )
            raise WeightUpdateError(f"{control['op']} update rejected before loading", problems)
        if not ok and flush:
            # loaded, but the flush was refused: requests were running; flush again at reset
            self._cache_dirty = True
        elif not ok:
            raise WeightUpdateError(f"SGLang failed the update: {message}")
        elif flush:
            self._cache_dirty = self._active > 0  # running requests keep adding to the cache
        elif deferred:
            self._cache_dirty = True  # still: the facade's reset flushes
        if not end_ok:
            raise WeightUpdateError(f"SGLang failed to finish the weight update: {end_message}")
        return outcomes[0]

    @staticmethod
    async def _send_update(tm: Any, req: Any, before_send: Callable[[], None] | None) -> Any:
        if before_send is not None:
            before_send()
        return await tm.update_weights_from_tensor(req, None)

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

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the scheduler, which checks all of it, then loads."""
        in_flight: list[str] = []
        dispatched: set[str] = set()

        def snapshot() -> None:
            # samples the tokenizer manager sent before the update message (see versions.py)
            in_flight.extend(r for rids in self._rids.values() for r in rids)
            states = getattr(self._tm, "rid_to_state", {})
            dispatched.update(r for r in in_flight if getattr(states.get(r), "dispatched", True))

        # SGLang would apply an unpaused update only after every running request finished (its
        # model-update lock); rlinfer applies it between engine steps, as vLLM does: running
        # requests are retracted (they keep their tokens) for the update and continue after it
        hold = self._active > 0 and not self._sglang_paused and not self._memory_paused
        if hold and flush_needs_idle() and self._gate is not None and self._gate.is_set():
            # this SGLang refuses to flush its cache while any request is pending, a retracted
            # one included: the update waits for the running requests (SGLang's own semantics),
            # new ones wait at the gate, and every token keeps the version that computed it
            outcome = await self._load_when_idle(update, snapshot)
        else:
            if hold:
                await self._sglang_pause_retract()
            try:
                outcome = await self._load(update, snapshot)
            finally:
                if hold:
                    await self._sglang_continue()
        version = update.version if update.version is not None else self._versions.current + 1
        lengths = outcome.get("lengths")
        if lengths is None:
            logger.warning("the scheduler did not report request lengths; in-flight tokens keep the old version")
            lengths, dispatched = {}, set(in_flight)
        self._versions.loaded(version, in_flight, dispatched, lengths)

    async def _load_when_idle(self, update: WeightUpdate, snapshot: Callable[[], None]) -> dict[str, Any]:
        assert self._gate is not None and self._idle is not None
        self._gate.clear()
        try:
            try:
                await self._guard(asyncio.wait_for(self._idle.wait(), timeout=self.config.request_timeout_s))
            except TimeoutError as exc:
                raise WeightUpdateError(
                    f"the requests in flight did not finish within {self.config.request_timeout_s:.0f} s; "
                    "nothing was loaded (this SGLang loads only between requests: pause(abort) first)"
                ) from exc
            return await self._load(update, snapshot)
        finally:
            self._gate.set()

    async def _sglang_pause_retract(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        await self._guard(self._alive().pause_generation(PauseGenerationReqInput(mode="retract")))

    async def _sglang_continue(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._guard(self._alive().continue_generation(ContinueGenerationReqInput()))

    async def _load(self, update: WeightUpdate, snapshot: Callable[[], None]) -> dict[str, Any]:
        from rlinfer_core.transfer import ipc

        source = update.source
        control: dict[str, Any]
        cuda_buckets = ipc.pack_cuda(source.tensors) if isinstance(source, NamedTensors) else None
        # exhaustive: a new WeightSource type is a mypy error here until it is handled
        match source:
            case NamedTensors() if cuda_buckets is not None:
                return await self._send_buckets(cuda_buckets, snapshot)
            case NamedTensors():
                return await self._scheduler_op(
                    {"op": "tensors"}, list(source.tensors), flush=True, before_send=snapshot
                )
            case Buckets():
                return await self._send_buckets(source.buckets, snapshot)
            case CheckpointDir():
                control = {"op": "disk", "path": str(Path(source.path).resolve())}
                return await self._scheduler_op(control, flush=True, before_send=snapshot)
            case BroadcastSource():
                specs = [(s.name, s.dtype, list(s.shape)) for s in source.specs]
                control = {"op": "broadcast", "group_name": self._group_name, "specs": specs}
                return await self._scheduler_op(control, flush=True, before_send=snapshot)
            case _:
                assert_never(source)

    async def _send_buckets(self, buckets: Sequence[Bucket], before_send: Callable[[], None]) -> dict[str, Any]:
        manifests = [attrs.asdict(b.manifest) for b in buckets]
        pairs = [(str(i), b.data) for i, b in enumerate(buckets)]
        control = {"op": "buckets", "manifests": manifests}
        return await self._scheduler_op(control, pairs, flush=True, before_send=before_send)

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
        if group.rank_offset + self._tp_size > group.world_size:  # a pool puts several engines in one group
            raise InvalidRequest(
                "world_size",
                f"must hold rank_offset ({group.rank_offset}) + {self._tp_size} engine ranks, got {group.world_size}",
            )
        try:
            await self._scheduler_op({"op": "join", "group": attrs.asdict(group)}, flush=False)
        except WeightUpdateError as exc:
            raise RLInferError(f"the SGLang scheduler could not join the weight group: {exc}") from exc
        self._group_name = group.group_name

    def _cache_stale(self) -> bool:
        """The radix cache may hold what older weights computed: a request ran since the last
        flush, or one is running (it keeps adding to the cache after a flush)."""
        return self._cache_dirty or self._active > 0

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """Flush SGLang's cache; running requests are retracted (recomputed) if they hold any."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        tm = self._alive()
        if not self._cache_stale():
            return
        if (await self._guard(tm.flush_cache())).success:
            self._cache_dirty = self._active > 0
            return
        if self._sglang_paused or self._memory_paused:
            raise RLInferError("SGLang refused to flush its cache while paused")
        await self._guard(tm.pause_generation(PauseGenerationReqInput(mode="retract")))
        try:
            flushed = (await self._guard(tm.flush_cache())).success
        finally:
            await self._guard(tm.continue_generation(ContinueGenerationReqInput()))
        if not flushed:
            raise RLInferError("SGLang refused to flush its cache")
        self._cache_dirty = self._active > 0

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """SGLang's own ``update_weights_from_disk``, no rlinfer validation."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        tm = self._alive()
        # the format named, not left to the tokenizer manager: it reads the process-wide config,
        # which the last SGLang engine opened in this process set (a dummy start's "dummy")
        request = UpdateWeightFromDiskReqInput(model_path=str(Path(path).resolve()), load_format="auto")
        # The scheduler's own flush refuses while a just-finished request is still in its running
        # batch (a race right after generate); flush through the same retrying reset rlinfer uses.
        deferred_flush = hasattr(request, "flush_cache")
        if deferred_flush:
            request.flush_cache = False
        ok, message, *_ = await self._guard(tm.update_weights_from_disk(request, None))
        if not ok:
            raise WeightUpdateError(f"SGLang update_weights_from_disk failed: {message}")
        self._cache_dirty = deferred_flush
        await self.rlinfer_reset_prefix_cache()


def flush_needs_idle() -> bool:
    """SGLang without begin/end_weight_update (0.5.16) refuses to flush its cache while any
    request is pending; its weight updates then wait for the running requests."""
    from sglang.srt.managers import io_struct

    return not hasattr(io_struct, "BeginWeightUpdateReqInput")
