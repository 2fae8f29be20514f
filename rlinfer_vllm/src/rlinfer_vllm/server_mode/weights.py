"""Server-mode weight hooks (a mixin): every transport through the server's ``/collective_rpc``
into :class:`rlinfer_vllm.worker.RLInferWorkerExtension` (the same worker code as in-process), and
the per-token version label through ``/update_weight_version`` (vLLM 0.26: rlinfer's
``/rlinfer/v1/weight_version``); plus the bench baselines.

Tensors travel as shared-memory / CUDA-IPC handles (:mod:`rlinfer_core.transfer.ipc`), base64 in
the JSON body; the worker maps the same memory. The load runs while the scheduler is paused
("keep": the caller's pause, or one taken here), and the engine's version label switches before
it resumes: every token computed after the load carries the new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlinfer_core.checksum import WeightChecksum
from rlinfer_core.errors import RLInferError, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.server_http import ServerError
from rlinfer_core.types import Capabilities, Capability, EngineConfig, GenerateRequest, PauseMode
from rlinfer_core.weights import (
    BroadcastGroup,
    TensorSpec,
    WeightUpdate,
)
from rlinfer_vllm.capabilities import Platform
from rlinfer_vllm.server_mode.engine_route import VERSION_PATH
from rlinfer_vllm.server_mode.http import ServerClient, b64
from rlinfer_vllm.weights import check_group, checksums, prepare_source, send_source

logger = logging.getLogger("rlinfer_vllm.server_mode")


class ServerWeightHooks:
    """Weight-sync and bench hooks of the server-mode backend."""

    config: EngineConfig
    platform: Platform
    version: int
    _caps: Capabilities
    _specs: dict[str, TensorSpec]
    _info: ModelInfo | None
    _pause_lock: asyncio.Lock
    _user_pause: PauseMode | None
    #: what the server's vLLM offers (``GET /rlinfer/v1/features``, see engine_route.features)
    _features: Mapping[str, Any]

    def _alive(self) -> ServerClient:
        raise NotImplementedError

    async def _send_resume(self, http: ServerClient) -> None:
        raise NotImplementedError

    async def rlinfer_reset_prefix_cache(self) -> None:
        """Implemented by the backend."""
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def _paused_for_load(self) -> AsyncIterator[ServerClient]:
        """Keep the scheduler paused while weights load: the caller's pause, or ``/pause?mode=keep``
        (vLLM answers once no step is in flight; KV caches are kept)."""
        http = self._alive()
        async with self._pause_lock:
            if self._user_pause is not None:
                yield http
                return
            await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            try:
                yield http
                await self.rlinfer_reset_prefix_cache()
            finally:
                # shielded: a cancelled or failed load must not leave the server paused
                with contextlib.suppress(RLInferError):  # a dead server raises on the next call
                    await asyncio.shield(self._send_resume(http))

    async def _label_version(self, http: ServerClient, version: int) -> None:
        """Label the tokens of every later step with ``version``: vLLM's ``/update_weight_version``
        where vLLM reports version spans (0.32), and rlinfer's route where the batch endpoint
        counts tokens itself (vLLM 0.26)."""
        if self._features.get("batch_via_engine"):
            await http.post(VERSION_PATH, {"new_version": str(version)})
        if self._features.get("token_version_spans", True):  # streams read vLLM's own spans
            await http.post("/update_weight_version", {"new_version": str(version)})

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names and shapes (dtypes as in-process)."""
        return dict(self._specs)

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the worker through the server (as in-process:
        :func:`rlinfer_vllm.weights.send_source`); all or nothing."""
        try:
            started = time.perf_counter()
            prepared = await prepare_source(update.source)
            async with self._paused_for_load() as http:

                async def rpc(method: str, *args: Any) -> Any:
                    return await http.rpc(method, *(b64(a) if isinstance(a, bytes) else a for a in args))

                worker = await send_source(update.source, prepared, rpc)
                if update.version is not None:
                    # the engine core labels the outputs of every later step with this version
                    await self._label_version(http, update.version)
                    self.version = update.version
            logger.debug("weight update over HTTP: %.1f ms; worker: %s", (time.perf_counter() - started) * 1e3, worker)
        except ServerError as exc:
            raise WeightUpdateError(f"vLLM failed to load the update: {exc}") from exc
        except (RLInferError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise WeightUpdateError(f"vLLM failed to load the update: {exc}") from exc

    @hookimpl
    async def rlinfer_weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums computed in the worker over what its kernels serve (as in-process)."""
        self._caps.require(Capability.WEIGHTS_CHECKSUM)
        tied = dict(self._info.tied_weights) if self._info is not None else {}
        return checksums(await self._alive().rpc("rlinfer_weights_checksum", tied))

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have the worker join the trainer's group (the call returns once every rank joined)."""
        check_group(self.platform, group)
        try:
            await self._alive().rpc("rlinfer_join_group", attrs.asdict(group))
        except ServerError as exc:
            raise WeightUpdateError(f"the vLLM worker could not join the broadcast group: {exc}") from exc

    # --- bench ---------------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch through the server's own ``/v1/completions`` (token-id prompts, the
        sampled tokens' logprobs), one HTTP call per request; tokens out."""
        http = self._alive()

        async def one(request: GenerateRequest) -> int:
            s = request.sampling
            body = {
                "prompt": list(request.prompt_token_ids or ()),
                "n": 1 if s.greedy else s.n,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "max_tokens": s.max_tokens,
                "min_tokens": s.min_tokens,
                "seed": s.seed,
                "ignore_eos": s.ignore_eos,
                "logprobs": s.logprobs,
                "return_token_ids": True,
            }
            answer = await http.post("/v1/completions", body, retry=False)
            copies = s.n if s.greedy else 1  # greedy n>1 is one sample, replicated
            return copies * sum(len(c.get("token_ids") or ()) for c in answer["choices"])

        return sum(await asyncio.gather(*(one(r) for r in requests)))

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """vLLM's own reload from disk through ``/collective_rpc`` (no validation)."""
        http = self._alive()
        resolved = str(Path(path).resolve())
        timeout = http.timeout_s
        await http.post(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": resolved}, "timeout": timeout},
            retry=False,
            close=True,
        )
        await http.rpc("rlinfer_shadow_from_dir", resolved)
