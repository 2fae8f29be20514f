"""The replicas of a pool: their actors, states and loads, bounded calls, restarts.

States: STARTING -> SERVING; a replica that dies or fails a weight load becomes FAILED (out of
routing at once), is restarted (a fresh actor in the same placement bundle, a fresh engine) and
re-synced to the pool's weights before it is SERVING again. When the pool's weights cannot be
replayed (they came by broadcast and nothing kept a copy), the restarted replica waits as STALE,
out of routing, until the next weight update reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import attrs

from rlinfer_core.errors import EngineDead, EngineTimeout
from rlinfer_core.types import EngineConfig
from rlinfer_ray.replica import ReplicaActor, unpack_error

logger = logging.getLogger(__name__)

#: bound on an engine's own shutdown inside a replica before its actor is killed
SHUTDOWN_TIMEOUT_S = 60.0


class State(enum.StrEnum):
    """Where a replica stands."""

    STARTING = "starting"
    SERVING = "serving"
    FAILED = "failed"
    STALE = "stale"
    STOPPED = "stopped"


@attrs.define(eq=False)
class Replica:
    """One replica as the pool sees it."""

    index: int
    actor: Any = None
    state: State = State.STARTING
    load: int = 0  #: samples in flight
    served: int = 0  #: requests (or request pieces) it completed
    version: int = 0  #: weight version it serves
    restarts: int = 0
    error: str | None = None  #: why it last failed
    pid: int | None = None  #: the actor's process
    generation: int = 0  #: bumped on every new actor (broadcast groups are tied to one)
    node_id: str | None = None  #: the Ray node it runs on
    procs: list[tuple[int, float]] = attrs.field(factory=list)  #: engine processes (pid, start time)


class ReplicaSet:
    """Creates, calls and restarts the replica actors of one pool."""

    def __init__(self, backend: str, config: EngineConfig, count: int) -> None:
        self.backend = backend
        self.config = config
        #: the placement group, and the shape of each replica's bundle in it (:meth:`place`)
        self.group: Any = None
        self.shape: dict[str, float] = {}
        self.replicas = [Replica(i) for i in range(count)]

    def place(self, group: Any, shape: dict[str, float]) -> None:
        """Run the replicas in ``group``, one bundle of ``shape`` each (before the first :meth:`spawn`)."""
        self.group, self.shape = group, shape

    def spawn(self, replica: Replica) -> None:
        """A new actor for ``replica`` in its placement bundle (the engine is not started yet)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(ReplicaActor).options(
            num_cpus=self.shape.get("CPU", 0.0),
            num_gpus=self.shape.get("GPU", 0.0),
            max_restarts=0,
            max_concurrency=1000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=replica.index
            ),
        )
        replica.actor = remote.remote(replica.index)
        replica.generation += 1
        replica.state = State.STARTING

    async def start(self, replica: Replica) -> dict[str, Any]:
        """Start the replica's engine (bounded by ``startup_timeout_s``); its facts."""
        info: dict[str, Any] = await self.call_raw(
            replica, replica.actor.start.remote(self.backend, self.config), self.config.startup_timeout_s, "start"
        )
        replica.pid = info["pid"]
        replica.node_id = info.get("node_id")
        replica.procs = list(info.get("procs", []))
        replica.version = 0
        return info

    async def call(self, replica: Replica, hook: str, *args: Any, timeout: float) -> Any:
        """The backend's operation ``hook(*args)`` on one replica, bounded by ``timeout``; typed
        errors come back typed."""
        return await self.call_raw(replica, replica.actor.call.remote(hook, *args), timeout, hook)

    async def load(self, replica: Replica, source: Any, version: int, timeout: float) -> None:
        """Load ``source`` (or the object-store reference to it) on one replica as ``version``."""
        await self.call_raw(replica, replica.actor.update_weights.remote(source, version), timeout, "update_weights")

    async def call_raw(self, replica: Replica, ref: Any, timeout: float, what: str) -> Any:
        """Await a replica reply ``ref``; EngineTimeout after ``timeout`` (the task is cancelled)."""
        import ray

        try:
            status, value = await asyncio.wait_for(ref, timeout=timeout)
        except TimeoutError:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            raise EngineTimeout(f"replica {replica.index}: {what} did not answer within {timeout:.0f} s") from None
        if status == "err":
            raise unpack_error(value, f"replica {replica.index}: ")
        return value

    async def fan_out(
        self, members: list[Replica], fn: Callable[[Replica], Coroutine[Any, Any, Any]]
    ) -> dict[int, Any]:
        """Run ``fn`` on every member at once; ``{index: result or the exception it raised}``."""
        results = await asyncio.gather(*(fn(r) for r in members), return_exceptions=True)
        return {r.index: res for r, res in zip(members, results, strict=True)}

    async def stop(self, replica: Replica, state: State = State.FAILED) -> None:
        """Shut the replica's engine down (bounded) and kill its actor; ``state`` afterwards."""
        import ray

        replica.state = state
        actor, replica.actor = replica.actor, None
        if actor is None:
            return
        with contextlib.suppress(Exception):  # a dead actor answers with an error at once
            await asyncio.wait_for(actor.call.remote("rlinfer_shutdown"), timeout=SHUTDOWN_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        # no reaping needed: Ray kills the process group of a worker that exits, engine processes included

    def serving(self, exclude: int | None = None) -> list[Replica]:
        """Replicas in routing."""
        return [r for r in self.replicas if r.state is State.SERVING and r.index != exclude]

    def alive(self) -> list[Replica]:
        """Replicas with a started engine (serving or waiting for weights)."""
        return [r for r in self.replicas if r.state in (State.SERVING, State.STALE)]


def death_message(replica: Replica, exc: BaseException) -> str:
    """One line on why a replica is out."""
    return f"replica {replica.index} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def raise_dead(replica: Replica, exc: BaseException) -> None:
    """EngineDead for a replica whose requests are not retried."""
    raise EngineDead(f"{death_message(replica, exc)}; retry is off (PoolConfig.retry)") from exc
