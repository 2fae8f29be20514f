"""Ray plumbing: join or start a cluster, reserve replica bundles in a placement group.

Nothing here is cluster code of its own: Ray schedules, places and restarts processes; this
module only asks it to.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from rlinfer_core.errors import EngineTimeout
from rlinfer_core.types import EngineConfig
from rlinfer_ray.config import PoolConfig

#: niceness of the worker processes of a local Ray instance the pool starts (Ray's default: 15)
WORKER_NICENESS = 0


def ensure_ray(pool: PoolConfig, cpus_needed: float) -> None:
    """Connect to Ray (``pool.ray_address`` / RAY_ADDRESS) or start a local instance.

    A local instance declares at least ``cpus_needed`` logical CPUs, so that a pool of small CPU
    engines fits on a laptop (Ray's CPUs are a scheduling unit, not a core pinning), and runs its
    workers at niceness 0: Ray's default (15) puts the replicas' engine processes below every
    other process of the machine, and on a machine with other work (a trainer's data loading,
    other engines) that measured 2-3x slower generation than the same engine outside Ray
    (docs/fleet.md). A joined cluster keeps its own setting (``RAY_worker_niceness=0 ray start``).
    """
    import ray

    if ray.is_initialized():
        return
    address = pool.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        return
    ray.init(
        num_cpus=max(int(cpus_needed + 0.999), os.cpu_count() or 1),
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
        _system_config={"worker_niceness": WORKER_NICENESS},
    )


def use_gpus(pool: PoolConfig, config: EngineConfig) -> bool:
    """Whether replica bundles hold GPUs."""
    if pool.accelerator != "auto":
        return pool.accelerator == "gpu"
    import ray

    return config.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0


def bundle(pool: PoolConfig, config: EngineConfig) -> dict[str, float]:
    """Resources of one replica: CPUs, plus one GPU per engine rank (EngineConfig.world_size) on GPU."""
    out = {"CPU": pool.cpus_per_replica}
    if use_gpus(pool, config):
        out["GPU"] = float(config.world_size)
    return out


async def reserve(pool: PoolConfig, shape: dict[str, float], timeout_s: float) -> Any:
    """A placement group of ``pool.replicas`` bundles, ready (or EngineTimeout)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([dict(shape)] * pool.replicas, strategy=pool.placement_strategy, name="")
    try:
        await asyncio.wait_for(group.ready(), timeout=timeout_s)
    except TimeoutError:
        remove_placement_group(group)
        raise EngineTimeout(
            f"Ray could not place {pool.replicas} replica bundles {shape} ({pool.placement_strategy}) within "
            f"{timeout_s:.0f} s; the cluster has {_resources()}"
        ) from None
    return group


def _resources() -> dict[str, float]:
    import ray

    return {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}


def release(group: Any) -> None:
    """Give a placement group back."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)
