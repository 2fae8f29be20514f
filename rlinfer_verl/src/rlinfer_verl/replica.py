"""verl's ``RolloutReplica`` for ``rollout.name: rlinfer``: one rlinfer server actor per replica.

verl builds one replica per rollout group and calls ``init_hybrid`` / ``init_colocated`` /
``init_standalone`` (verl's code: placement, worker groups), which end in :meth:`launch_servers`.
Here that starts :class:`rlinfer_verl.server.RlinferServer` as a named Ray actor, placed where
the replica's workers are (their node and visible devices, as verl's SGLang replica does) when
there are workers, anywhere in the Ray cluster otherwise. The engine's own ranks (tensor
parallelism) and an rlinfer-ray pool's replicas are started by rlinfer inside that actor.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from verl.workers.rollout.replica import RolloutReplica

from rlinfer_verl.names import model_path_of, server_actor_name
from rlinfer_verl.server import RlinferServer


class RlinferReplica(RolloutReplica):  # type: ignore[misc]  # verl is untyped
    """A verl rollout replica whose server is an rlinfer engine (see the module docstring)."""

    def _role(self) -> str:
        return "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else ""

    async def _placement(self) -> dict[str, Any]:
        """Ray options that put the server beside the replica's workers (none without workers)."""
        if not self.workers:
            return {}
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        from verl.utils.device import get_visible_devices_keyword

        keyword = get_visible_devices_keyword()
        infos = await asyncio.gather(
            *[
                worker.__ray_call__.remote(
                    lambda self: (ray.get_runtime_context().get_node_id(), os.environ.get(keyword, ""))
                )
                for worker in self.workers
            ]
        )
        devices = sorted({int(d) for _, seen in infos for d in seen.split(",") if d.strip()})
        env = {keyword: ",".join(map(str, devices))} if devices else {}
        return {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=infos[0][0], soft=False),
            "runtime_env": {"env_vars": env},
        }

    async def launch_servers(self) -> None:
        """Start this replica's server actor and its engine."""
        import ray

        if self.nnodes > 1:
            raise ValueError(
                f"rlinfer-verl runs each replica on one node; this one needs {self.nnodes} "
                f"(world size {self.world_size} > {self.gpus_per_replica_node} devices per node)"
            )
        name = server_actor_name(self.replica_rank, self._role(), self.name_suffix.lstrip("_"))
        server = (
            ray.remote(RlinferServer)
            .options(name=name, max_concurrency=self.max_concurrency, **(await self._placement()))
            .remote(
                config=self.config,
                model_path=model_path_of(self.model_config),
                rollout_mode=getattr(self.rollout_mode, "value", self.rollout_mode),
                replica_rank=self.replica_rank,
            )
        )
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server
        # rlinfer serve over the engine with custom.rlinfer.http; None: token in/out through the actor
        self._server_address = await server.server_address.remote()
