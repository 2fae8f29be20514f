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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rlinfer_core.errors import InvalidRequest, RLInferError, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
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

logger = logging.getLogger(__name__)


class WeightChannel(BackendBase):
    """Weight specs, updates over every transport, broadcast groups and prefix-cache reset."""

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names, in the engine's dtype, with their shapes."""
        return dict(self._specs)

    async def _scheduler_op(
        self, control: dict[str, Any], tensors: Sequence[tuple[str, Any]] = (), *, flush: bool
    ) -> None:
        """Run rlinfer's scheduler-side loader once on every TP rank; raise on any failure."""
        from sglang.srt.managers import io_struct
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        from rlinfer_sglang.scheduler_side import encode_control

        tm = self._alive()
        result = self._result_dir / uuid.uuid4().hex
        pairs = [encode_control({**control, "result": str(result)}), *tensors]
        loop = asyncio.get_running_loop()
        payload = await loop.run_in_executor(None, MultiprocessingSerializer.serialize, pairs)
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload] * self._tp_size, load_format=WEIGHT_LOADER, flush_cache=flush
        )
        # SGLang >= 0.5.2x wraps tensor updates in begin/end_weight_update; 0.5.16 has neither.
        begin = getattr(io_struct, "BeginWeightUpdateReqInput", None)
        end = getattr(io_struct, "EndWeightUpdateReqInput", None)
        if begin is not None:
            ok, message = await self._guard(tm.begin_weight_update(begin(), None))
            if not ok:
                raise WeightUpdateError(f"SGLang refused to open a weight update: {message}")
        end_ok, end_message = True, ""
        try:
            ok, message = (await self._guard(tm.update_weights_from_tensor(req, None)))[:2]
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
            self._cache_dirty = False
        if not end_ok:
            raise WeightUpdateError(f"SGLang failed to finish the weight update: {end_message}")

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
        from rlinfer_core.transfer import ipc

        source = update.source
        cuda_buckets = ipc.pack_cuda(source.tensors) if isinstance(source, NamedTensors) else None
        if cuda_buckets is not None:
            await self._send_buckets(cuda_buckets)
        elif isinstance(source, NamedTensors):
            await self._scheduler_op({"op": "tensors"}, list(source.tensors), flush=True)
        elif isinstance(source, Buckets):
            await self._send_buckets(source.buckets)
        elif isinstance(source, CheckpointDir):
            await self._scheduler_op({"op": "disk", "path": str(Path(source.path).resolve())}, flush=True)
        elif isinstance(source, BroadcastSource):
            specs = [(s.name, s.dtype, list(s.shape)) for s in source.specs]
            await self._scheduler_op({"op": "broadcast", "group_name": self._group_name, "specs": specs}, flush=True)
        else:
            raise WeightUpdateError(f"unknown weight source {type(source).__name__}")

    async def _send_buckets(self, buckets: Sequence[Bucket]) -> None:
        manifests = [attrs.asdict(b.manifest) for b in buckets]
        pairs = [(str(i), b.data) for i, b in enumerate(buckets)]
        await self._scheduler_op({"op": "buckets", "manifests": manifests}, pairs, flush=True)

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have every scheduler rank join the trainer's group (blocks until all ranks joined)."""
        if self.platform == "cpu" and group.backend != "gloo":
            raise InvalidRequest("backend", "SGLang on CPU joins gloo groups only")
        if group.world_size != 1 + self._tp_size:
            raise InvalidRequest(
                "world_size", f"must be 1 (trainer) + {self._tp_size} (engine ranks), got {group.world_size}"
            )
        try:
            await self._scheduler_op({"op": "join", "group": attrs.asdict(group)}, flush=False)
        except WeightUpdateError as exc:
            raise RLInferError(f"the SGLang scheduler could not join the weight group: {exc}") from exc
        self._group_name = group.group_name

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """Flush SGLang's cache; running requests are retracted (recomputed) if they hold any."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        tm = self._alive()
        if not self._cache_dirty:
            return
        if (await self._guard(tm.flush_cache())).success:
            self._cache_dirty = False
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
        self._cache_dirty = False

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """SGLang's own ``update_weights_from_disk``, no rlinfer validation."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        tm = self._alive()
        ok, message, *_ = await self._guard(
            tm.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=str(Path(path).resolve())), None)
        )
        if not ok:
            raise WeightUpdateError(f"SGLang update_weights_from_disk failed: {message}")
        self._cache_dirty = False
