"""The pool's own settings (the engine's are an ordinary :class:`rlinfer_core.EngineConfig`)."""

from __future__ import annotations

import enum
from typing import Literal

import attrs

from rlinfer_core import _validate as v


class RouterPolicy(enum.StrEnum):
    """How the data plane picks a replica for a request (or for one sample of an ``n>1`` group)."""

    LEAST_OUTSTANDING = "least_outstanding"  #: fewest samples in flight (default)
    ROUND_ROBIN = "round_robin"  #: in turn
    SESSION = "session"  #: sticky per session key, with bounded load (see rlinfer_ray.router)


def _policy(value: object) -> RouterPolicy:
    from rlinfer_core.errors import InvalidRequest

    try:
        return RouterPolicy(str(value))
    except ValueError:
        raise InvalidRequest("policy", f"must be one of {[p.value for p in RouterPolicy]}, got {value!r}") from None


@attrs.frozen
class PoolConfig:
    """How many replicas, how requests are routed, how faults are handled, where Ray runs."""

    replicas: int = attrs.field(default=2, validator=v.in_range(1, 4096, integer=True))
    policy: RouterPolicy = attrs.field(default=RouterPolicy.LEAST_OUTSTANDING, converter=_policy)
    #: a session may exceed the mean load per replica by this factor before it spills over
    session_load_factor: float = attrs.field(default=1.25, validator=v.in_range(1.0, 100.0))
    #: split an unseeded ``n>1`` request across replicas (samples re-indexed 0..n-1)
    spread_n: bool = attrs.field(default=True, validator=v.instance_of(bool, "a bool"))
    #: requests in flight on a replica that dies are run again on another replica; when False
    #: the caller gets EngineDead naming the replica
    retry: bool = attrs.field(default=True, validator=v.instance_of(bool, "a bool"))
    max_retries: int = attrs.field(default=2, validator=v.in_range(0, 100, integer=True))
    #: restart a replica that died or failed a weight load, then re-sync it to the pool's weights
    restart: bool = attrs.field(default=True, validator=v.instance_of(bool, "a bool"))
    #: bound on control-plane calls that are not generation or weight loads (health, abort, ...)
    control_timeout_s: float = attrs.field(default=60.0, validator=v.in_range(0.0, 3600.0, low_open=True))
    #: logical CPUs reserved per replica bundle
    cpus_per_replica: float = attrs.field(default=1.0, validator=v.in_range(0.0, 1024.0, low_open=True))
    #: "cpu", "gpu" (bundles of tensor_parallel_size GPUs) or "auto" (gpu when the cluster has GPUs
    #: and the engine config does not ask for the CPU)
    accelerator: Literal["auto", "cpu", "gpu"] = attrs.field(default="auto", validator=v.one_of("auto", "cpu", "gpu"))
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = attrs.field(
        default="PACK", validator=v.one_of("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
    )
    #: Ray cluster to join ("auto": the one ``ray start`` made on this node); None: join the one
    #: in RAY_ADDRESS or start a local one
    ray_address: str | None = None
