"""verl's ``BaseRollout`` server adapter for ``rollout.name: rlinfer``: the trainer side.

verl builds one adapter in each trainer worker (hybrid mode) or checkpoint-engine worker and calls
``resume(tags)`` / ``release()`` around training and ``update_weights(generator)`` after each step,
as it does for its vLLM and SGLang adapters. Every rank consumes the generator (producing it may
be collective, e.g. FSDP gathering full tensors); the replica's first rank sends the full
``(name, tensor)`` pairs to its server actor, which loads them with one rlinfer weight update
(all or nothing, checksum-verified). Tensors travel as CPU tensors through Ray's object store:
correct on any device, a copy through host memory on GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from verl.workers.rollout.base import BaseRollout

from rlinfer_core.errors import UnsupportedCapability
from rlinfer_verl.names import server_actor_name


class ServerAdapter(BaseRollout):  # type: ignore[misc]  # verl is untyped
    """The trainer's handle on its replica's rlinfer server (see the module docstring)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self._server: Any = None

    @property
    def is_leader(self) -> bool:
        """Whether this rank talks to the server (the replica's first rank)."""
        return bool(self.rollout_rank == 0)

    def _actor(self) -> Any:
        if self._server is None:
            import ray

            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        """Re-allocate ``tags`` (weights, kv_cache) on the server, with ``free_cache_engine``."""
        if self.is_leader and self.config.free_cache_engine:
            await self._actor().resume_memory.remote(list(tags))

    async def release(self) -> None:
        """Free the server's weights and KV cache, with ``free_cache_engine``
        (UnsupportedCapability where the platform cannot, e.g. CPU)."""
        if self.is_leader and self.config.free_cache_engine:
            await self._actor().release_memory.remote(["kv_cache", "weights"])

    async def update_weights(
        self,
        weights: Iterable[tuple[str, Any]],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        """Send the generator's ``(name, tensor)`` pairs to the server as one all-or-nothing,
        verified update; the server then serves ``global_steps``."""
        if wire_format != "named_tensors":
            raise UnsupportedCapability(
                f"weights.{wire_format}", "rlinfer", "rlinfer-verl takes full named tensors (wire_format=named_tensors)"
            )
        if kwargs.get("peft_config") is not None and kwargs.get("base_sync_done"):
            raise UnsupportedCapability(
                "lora", "rlinfer", "rlinfer-verl loads merged weights; set actor_rollout_ref.model.lora.merge=true"
            )
        pairs = [(name, tensor.detach().to("cpu")) for name, tensor in weights]
        if self.is_leader:
            await self._actor().update_weights.remote(pairs, global_steps)
