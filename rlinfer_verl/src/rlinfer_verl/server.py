"""The rollout server of one verl replica: an rlinfer engine behind verl's server-actor calls.

verl's agent loop calls ``generate`` on the replica's server actor (token ids in, ``TokenOutput``
out); its ``RolloutReplica`` calls ``wake_up`` / ``sleep`` / ``abort_all_requests`` /
``resume_generation`` / the KV-cache calls; the trainer's ``ServerAdapter``
(:mod:`rlinfer_verl.adapter`) calls ``update_weights`` / ``release_memory`` / ``resume_memory``.
The engine is an rlinfer ``AsyncEngine`` (in process, or ``serving: server``) or an rlinfer-ray
pool (``custom.rlinfer.pool``, ``rlinfer_ray.open_async_pool``). Each call does what verl's own vLLM / SGLang servers do
(``verl/workers/rollout/{vllm,sglang}_rollout``), on rlinfer's contract: weight updates are all or
nothing and checksum-verified (``EngineConfig.verify_updates``), and what the engine cannot do on
this platform raises UnsupportedCapability instead of passing silently.

verl wraps this class with ``ray.remote`` (:class:`rlinfer_verl.replica.RlinferReplica`); tests
drive it directly too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from rlinfer_core.errors import InvalidRequest, UnsupportedCapability
from rlinfer_core.types import GenerateRequest, MemoryTag
from rlinfer_core.weights import NamedTensors
from rlinfer_verl.config import RlinferRollout, rlinfer_rollout
from rlinfer_verl.sampling import as_token_ids, token_output_fields, verl_request

logger = logging.getLogger(__name__)

#: verl's rollout modes (verl.workers.rollout.replica.RolloutMode values)
HYBRID, COLOCATED, STANDALONE = "hybrid", "colocated", "standalone"


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "value", mode) or STANDALONE)


class RlinferServer:
    """One replica's engine with verl's server-actor API (see the module docstring).

    ``config``: verl's RolloutConfig (``name: rlinfer``); ``model_path``: the model directory
    (verl's ``HFModelConfig.local_path``); ``rollout_mode``: verl's RolloutMode (or its value).
    """

    def __init__(self, config: Any, model_path: str, rollout_mode: Any = STANDALONE, replica_rank: int = 0) -> None:
        self.rollout: RlinferRollout = rlinfer_rollout(config, model_path)
        for note in self.rollout.notes:
            logger.info("%s", note)
        self.rollout_mode = _mode_name(rollout_mode)
        self.replica_rank = replica_rank
        self.full_determinism = bool(_get(config, "full_determinism", False))
        self.seed = int(_get(config, "seed", 0) or 0)
        self.free_cache_engine = bool(_get(config, "free_cache_engine", True))
        #: the trainer's step of the served weights (verl's ``global_steps``), set by update_weights
        self.global_steps: int | None = None
        self.engine: Any = None
        #: rlinfer serve over the engine (rlinfer_verl.http.HttpFace) with custom.rlinfer.http
        self.http: Any = None

    # --- lifecycle -------------------------------------------------------------------------------

    async def launch_server(self, master_address: str | None = None, master_port: int | None = None) -> None:
        """Open the engine (or pool). verl's multi-node arguments are for engines spanning nodes:
        an rlinfer replica is one engine (or a pool that places its own replicas)."""
        if master_address is not None or master_port is not None:
            raise UnsupportedCapability(
                "parallel.multi_node", self.rollout.backend, "an rlinfer-verl replica runs on one node"
            )
        if self.engine is not None:
            return
        if self.rollout.pool is not None:
            from rlinfer_ray import open_async_pool
            from rlinfer_ray.config_file import pool_config

            self.engine = await open_async_pool(
                self.rollout.backend, self.rollout.engine, pool=pool_config(self.rollout.pool)
            )
        else:
            from rlinfer_core.engine import AsyncEngine

            self.engine = await AsyncEngine.open(self.rollout.backend, self.rollout.engine)
        if self.rollout.http is not None:
            from rlinfer_verl.http import serve_http

            try:
                self.http = await serve_http(self.engine, self.rollout.http)
            except BaseException:
                await self.engine.shutdown()
                raise

    async def shutdown(self) -> None:
        """Stop the HTTP server and the engine (safe to call twice)."""
        if self.http is not None:
            await self.http.stop()
        if self.engine is not None:
            await self.engine.shutdown()

    def get_server_address(self) -> tuple[str, int] | None:
        """verl's HTTP address of the server: rlinfer serve's over the engine with
        ``custom.rlinfer.http``; None otherwise (verl then drives the replica through this actor
        only, token in, token out)."""
        return (self.http.host, self.http.port) if self.http is not None else None

    def server_address(self) -> str | None:
        """:meth:`get_server_address` as verl's ``host:port`` string (None without HTTP)."""
        return self.http.address if self.http is not None else None

    # --- generation ------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: Sequence[int] | Any,
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> Any:
        """Generate from token ids; return verl's ``TokenOutput`` (token ids, their logprobs when
        ``sampling_params["logprobs"]``, routed experts when the engine captures them, stop reason
        ``completed`` / ``aborted``, ``extra_fields.global_steps``)."""
        from verl.workers.rollout.replica import TokenOutput

        if any(x is not None for x in (image_data, video_data, audio_data)) or mm_processor_kwargs:
            raise UnsupportedCapability(
                "generate.multimodal", self.rollout.backend, "rlinfer's requests are token ids or text messages"
            )
        prompt = as_token_ids(prompt_ids)
        seed = self.replica_rank + self.seed if self.full_determinism else None
        config = self.engine.config
        request = verl_request(sampling_params, len(prompt), config, seed=seed, routed=config.enable_routed_experts)
        if request.sampling.n != 1:
            raise InvalidRequest("n", f"verl's generate returns one sample per call, got n={request.sampling.n}")
        if priority:
            raise UnsupportedCapability(
                "generate.priority", self.rollout.backend, "rlinfer-verl does not forward request priorities"
            )
        [completion] = await self.engine.generate(
            GenerateRequest(prompt_token_ids=prompt, sampling=request.sampling, request_id=request_id)
        )
        return TokenOutput(**token_output_fields(completion, request, self.global_steps))

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Abort what is in flight (its callers get their partial tokens, stop reason ``aborted``)
        and hold new requests until :meth:`resume_generation`, as verl's servers do. Held requests
        wait whatever ``reject_request`` says (logged, as verl's SGLang server does)."""
        if reject_request:
            logger.warning("rlinfer-verl: reject_request=True: new requests wait for resume_generation instead")
        await self.engine.pause("abort")

    async def resume_generation(self) -> None:
        """Let requests in again after :meth:`abort_all_requests`."""
        await self.engine.resume()

    async def set_global_steps(self, global_steps: int) -> None:
        """The trainer step of the weights now served (verl's ``global_steps``)."""
        self.global_steps = global_steps

    # --- weights ---------------------------------------------------------------------------------

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], global_steps: int | None = None) -> int:
        """Load ``(name, tensor)`` pairs, all or nothing, verified by checksum when the engine
        reports them; returns the new weight version. The prefix cache is dropped by the engine."""
        version: int = await self.engine.update_weights(NamedTensors.of(list(named_tensors)))
        if global_steps is not None:
            self.global_steps = global_steps
        return version

    async def weights_checksum(self) -> dict[str, Any]:
        """The engine's checksums of what it serves (rlinfer's ``weights_checksum``)."""
        return dict(await self.engine.weights_checksum())

    async def weight_version(self) -> int:
        """The engine's weight version (0 until the first update)."""
        return int(self.engine.weight_version)

    # --- memory (verl's sleep / wake_up and the adapter's release / resume) ----------------------

    async def release_memory(self, tags: Sequence[str]) -> None:
        """Free ``tags`` (weights, kv_cache); UnsupportedCapability where the platform cannot."""
        await self.engine.release_memory(list(tags))

    async def resume_memory(self, tags: Sequence[str]) -> None:
        """Re-allocate ``tags`` freed by :meth:`release_memory`."""
        await self.engine.resume_memory(list(tags))

    async def wake_up(self) -> None:
        """verl's wake_up: colocated replicas get weights and KV cache back, standalone ones the KV
        cache; hybrid replicas are woken by the trainer's adapter (``resume``), as in verl."""
        if self.rollout_mode == HYBRID:
            raise InvalidRequest("rollout_mode", "wake_up is not for hybrid replicas (the ServerAdapter resumes them)")
        tags = [MemoryTag.WEIGHTS, MemoryTag.KV_CACHE] if self.rollout_mode == COLOCATED else [MemoryTag.KV_CACHE]
        if self.engine.released & set(tags):
            await self.engine.resume_memory([t for t in tags if t in self.engine.released])
            await self.engine.reset_prefix_cache()

    async def sleep(self) -> None:
        """verl's sleep: with ``free_cache_engine``, hybrid and colocated replicas free weights and
        KV cache, standalone ones the KV cache (UnsupportedCapability where the platform cannot)."""
        if not self.free_cache_engine:
            return
        tags = [MemoryTag.KV_CACHE] if self.rollout_mode == STANDALONE else [MemoryTag.KV_CACHE, MemoryTag.WEIGHTS]
        await self.engine.release_memory(tags)

    async def clear_kv_cache(self) -> None:
        """Drop cached prefixes."""
        await self.engine.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        """Free the KV cache only (with ``free_cache_engine``)."""
        if self.free_cache_engine:
            await self.engine.release_memory([MemoryTag.KV_CACHE])

    async def resume_kv_cache(self) -> None:
        """Re-allocate the KV cache after :meth:`release_kv_cache`."""
        if self.free_cache_engine:
            await self.engine.resume_memory([MemoryTag.KV_CACHE])
            await self.engine.reset_prefix_cache()

    async def start_profile(self, **kwargs: Any) -> None:
        """verl's rollout profiler: not wired to rlinfer's engines (UnsupportedCapability)."""
        raise UnsupportedCapability("profile", self.rollout.backend, "rlinfer-verl does not drive engine profilers")

    async def stop_profile(self) -> None:
        """See :meth:`start_profile`."""
        raise UnsupportedCapability("profile", self.rollout.backend, "rlinfer-verl does not drive engine profilers")


def _get(config: Any, key: str, default: Any) -> Any:
    if hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)
