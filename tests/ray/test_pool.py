"""The pool (an Engine over a PoolBackend) against real engines on a local Ray cluster: routing,
fan-out, faults.

Every test leaves the pool serving the base weights with both replicas up.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from rlinfer_core.errors import EngineDead, WeightUpdateError
from rlinfer_core.types import FinishReason, GenerateRequest, SamplingParams
from rlinfer_core.weights import NamedTensors
from rlinfer_ray.config import RouterPolicy
from rlinfer_ray.pool import pool_backend
from rlinfer_ray.router import Router

#: a replica killed on this CPU machine is back (new engine, weights re-synced) within this; the
#: documented bound in docs/fleet.md
RESTART_BOUND_S = 300.0
PROMPTS = [[1, 5, 9], [1, 7], [2, 3, 4, 5], [11, 12]]


def _greedy(prompts: list[list[int]], max_tokens: int = 8) -> list[GenerateRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [GenerateRequest(prompt_token_ids=p, sampling=params) for p in prompts]


def _served(pool: Any) -> list[int]:
    return [r.served for r in pool_backend(pool).replicas.replicas]


def _tensors(model_dir: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return sorted(out.items())


def _kill_actor(pool: Any, index: int) -> None:
    pid = pool_backend(pool).replicas.replicas[index].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def _outputs_per_replica(pool: Any) -> list[list[tuple[int, ...]]]:
    """Greedy tokens of three prompts on replica 0 and on replica 1: a fresh round-robin router
    sends batch positions 0, 2, 4 to one replica and 1, 3, 5 to the other, so prompt i (at i and
    i + 3) runs once on each."""
    saved = pool_backend(pool).router
    pool_backend(pool).router = Router(RouterPolicy.ROUND_ROBIN)
    try:
        out = pool.generate(_greedy(PROMPTS[:3] * 2))
    finally:
        pool_backend(pool).router = saved
    tokens = [c.token_ids for c in out]
    return [tokens[:3], tokens[3:]]


def test_pool_reports_the_backend(pool: Any) -> None:
    assert pool.backend_name == pool.capabilities.backend
    assert pool_backend(pool).replica_states() == ["serving", "serving"]
    # vLLM's replicas salt their prefix caches by weight version: a pool update resets none of them
    assert pool_backend(pool).update_invalidates_prefixes
    procs = pool.engine_processes()
    assert {"replica0.actor", "replica1.actor"} <= set(procs)
    assert len(procs) > 2, f"engine processes of the replicas are listed: {procs}"
    import psutil

    # Ray's default worker niceness (15) starves the engines behind any other process (docs/fleet.md)
    assert {name: psutil.Process(pid).nice() for name, pid in procs.items()} == dict.fromkeys(procs, 0)


def test_least_outstanding_spreads_a_batch(pool: Any) -> None:
    before = _served(pool)
    out = pool.generate(_greedy(PROMPTS * 2))
    after = _served(pool)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    # same weights everywhere: the same prompt gives the same greedy tokens on either replica
    assert [c.token_ids for c in out[:4]] == [c.token_ids for c in out[4:]]
    assert all(c.token_versions == (pool.weight_version,) * len(c.token_ids) for c in out)


def test_group_is_spread_and_reindexed(pool: Any) -> None:
    before = _served(pool)
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4, n=6))
    out = pool.generate(request)
    after = _served(pool)
    assert [c.index for c in out] == list(range(6))
    assert {c.request_id for c in out} == {request.request_id}
    assert all(a > b for a, b in zip(after, before, strict=True)), "the group's samples ran on both replicas"


def test_seeded_group_is_reproducible_across_replicas(pool: Any) -> None:
    request = SamplingParams(max_tokens=6, n=3, seed=11)
    first = pool.generate(GenerateRequest(prompt_token_ids=[4, 5], sampling=request))
    second = pool.generate(GenerateRequest(prompt_token_ids=[4, 5], sampling=request))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]


def test_session_affinity_with_bounded_load(pool: Any) -> None:
    saved = pool_backend(pool).router
    pool_backend(pool).router = Router(RouterPolicy.SESSION, load_factor=1.25)
    try:
        before = _served(pool)
        for _ in range(4):
            with pool_backend(pool).session("user-1"):
                pool.generate(_greedy(PROMPTS[:1]))
        after = _served(pool)
        moved = [a - b for a, b in zip(after, before, strict=True)]
        assert sorted(moved) == [0, 4], f"one session stays on one replica: {moved}"
        before = after
        group = GenerateRequest(prompt_token_ids=[3, 4], sampling=SamplingParams(max_tokens=4, n=8))
        with pool_backend(pool).session("user-1"):
            out = pool.generate(group)
        after = _served(pool)
        assert [c.index for c in out] == list(range(8))
        assert all(a > b for a, b in zip(after, before, strict=True)), "a hot group spills over (bounded load)"
    finally:
        pool_backend(pool).router = saved


def test_bad_update_touches_no_replica(pool: Any, model_dirs: dict[str, Path]) -> None:
    version = pool.weight_version
    before = _outputs_per_replica(pool)
    tensors = _tensors(model_dirs["other"])
    poisoned = [(n, t.clone().fill_(float("nan")) if i == 0 else t) for i, (n, t) in enumerate(tensors)]
    with pytest.raises(WeightUpdateError):
        pool.update_weights(NamedTensors.of(poisoned))
    assert pool.weight_version == version
    assert [r.version for r in pool_backend(pool).replicas.replicas] == [version, version]
    assert _outputs_per_replica(pool) == before


def test_update_with_one_replica_failing_its_load(pool: Any, model_dirs: dict[str, Path]) -> None:
    base = _outputs_per_replica(pool)
    version = pool.weight_version
    # a real failure: replica 1's engine process dies, so its load fails (the actor survives)
    victim = pool_backend(pool).replicas.replicas[1]
    for pid, _ in victim.procs:
        os.kill(pid, signal.SIGKILL)
    assert victim.procs, "the replica reported its engine processes"
    new = pool.update_weights(NamedTensors.of(_tensors(model_dirs["other"])))
    assert new == version + 1 == pool.weight_version
    assert pool_backend(pool).replica_states()[1] != "serving", "the failed replica left routing at once"
    before = _served(pool)
    out = pool.generate(_greedy(PROMPTS))
    assert _served(pool)[1] == before[1], "nothing is routed to the failed replica"
    assert all(set(c.token_versions) == {new} for c in out)
    started = time.monotonic()
    pool_backend(pool).wait_ready_blocking(RESTART_BOUND_S)
    print(f"replica restart + re-sync: {time.monotonic() - started:.1f} s")
    assert [r.version for r in pool_backend(pool).replicas.replicas] == [new, new]
    runs = _outputs_per_replica(pool)
    assert runs[0] == runs[1] != base[0], "both replicas serve the new weights"
    pool.update_weights(NamedTensors.of(_tensors(model_dirs["base"])))
    assert _outputs_per_replica(pool) == base


def test_one_broadcast_reaches_every_replica(pool: Any, model_dirs: dict[str, Path]) -> None:
    from rlinfer_core.transfer.broadcast import WeightBroadcaster, free_port
    from rlinfer_core.weights import BroadcastGroup

    base = _outputs_per_replica(pool)
    assert pool.broadcast_ranks == 2
    group = BroadcastGroup("127.0.0.1", free_port(), world_size=1 + pool.broadcast_ranks, timeout_s=60.0)
    with concurrent.futures.ThreadPoolExecutor(2) as helper:
        joined = helper.submit(pool.init_weight_broadcast, group)
        sender = WeightBroadcaster(group)
        try:
            joined.result(timeout=120)
            tensors = _tensors(model_dirs["other"])
            pending = helper.submit(pool.update_weights, sender.source(tensors))
            sender.send(tensors)  # once, for both replicas
            version = pending.result(timeout=120)
        finally:
            sender.close()
    assert version == pool.weight_version
    runs = _outputs_per_replica(pool)
    assert runs[0] == runs[1] != base[0]
    pool.update_weights(NamedTensors.of(_tensors(model_dirs["base"])))
    answered = pool_backend(pool).last_update_fanout_s
    assert sorted(answered) == [0, 1] and all(s > 0 for s in answered.values()), answered
    assert _outputs_per_replica(pool) == base


def _long(count: int) -> list[GenerateRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    return [GenerateRequest(prompt_token_ids=[1, 20 + i], sampling=params) for i in range(count)]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_busy(pool: Any, index: int) -> None:
    deadline = time.monotonic() + 30
    while pool_backend(pool).replicas.replicas[index].load == 0:
        assert time.monotonic() < deadline, "the requests never reached the replica"
        time.sleep(0.05)


def test_replica_killed_mid_generate_is_retried_and_restarted(pool: Any) -> None:
    requests = _long(4)
    orphans = list(pool_backend(pool).replicas.replicas[0].procs)
    assert orphans, "the replica reported its engine processes"
    before = _served(pool)
    with concurrent.futures.ThreadPoolExecutor(1) as helper:
        future = helper.submit(pool.generate, requests)
        _wait_busy(pool, 0)
        _wait_busy(pool, 1)  # the batch is split: two requests in flight on each replica
        _kill_actor(pool, 0)
        out = future.result(timeout=300)
    assert [c.finish_reason for c in out] == [FinishReason.LENGTH] * 4
    assert all(len(c.token_ids) == 300 for c in out)
    after = _served(pool)
    assert after[1] - before[1] == 4, "replica 1 served its own two requests and the two retried from replica 0"
    assert after[0] == before[0], "nothing completed on the killed replica"
    started = time.monotonic()
    pool_backend(pool).wait_ready_blocking(RESTART_BOUND_S)
    print(f"replica restart after a kill: {time.monotonic() - started:.1f} s")
    assert pool_backend(pool).replicas.replicas[0].restarts >= 1
    assert not [pid for pid, _ in orphans if _alive(pid)], "the killed replica's engine processes are gone"
    assert len(pool.generate(_greedy(PROMPTS * 2))) == 8


def test_retry_off_gives_engine_dead(pool: Any) -> None:
    saved = pool_backend(pool).pool_config
    pool_backend(pool).pool_config = attrs.evolve(saved, retry=False)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as helper:
            future = helper.submit(pool.generate, _long(4))
            _wait_busy(pool, 1)
            _kill_actor(pool, 1)
            with pytest.raises(EngineDead, match="replica 1"):
                future.result(timeout=120)
    finally:
        pool_backend(pool).pool_config = saved
    pool_backend(pool).wait_ready_blocking(RESTART_BOUND_S)
    assert pool_backend(pool).replica_states() == ["serving", "serving"]
