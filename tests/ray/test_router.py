"""The router's policies, and the replica's engine config, on their own (no Ray)."""

from __future__ import annotations

import math

from rlinfer_ray.config import RouterPolicy
from rlinfer_ray.router import Router, session_order


def test_least_outstanding_picks_the_least_loaded() -> None:
    router = Router(RouterPolicy.LEAST_OUTSTANDING)
    assert router.pick([0, 1, 2], {0: 5, 1: 1, 2: 3}) == 1
    # ties rotate: an idle pool spreads
    assert {router.pick([0, 1], {0: 0, 1: 0}) for _ in range(4)} == {0, 1}


def test_round_robin_cycles() -> None:
    router = Router(RouterPolicy.ROUND_ROBIN)
    assert [router.pick([3, 4, 5], {3: 9}) for _ in range(6)] == [3, 4, 5, 3, 4, 5]


def test_session_is_sticky_while_under_the_bound() -> None:
    router = Router(RouterPolicy.SESSION, load_factor=1.25)
    home = session_order("user-7", [0, 1, 2])[0]
    assert {router.pick([0, 1, 2], {}, 1, "user-7") for _ in range(10)} == {home}
    keys = [f"s{i}" for i in range(32)]
    assert {session_order(k, [0, 1, 2])[0] for k in keys} == {0, 1, 2}, "sessions hash onto every replica"


def test_hot_session_cannot_pin_a_group() -> None:
    router = Router(RouterPolicy.SESSION, load_factor=1.25)
    shares = router.spread([0, 1], {}, 16, "hot")
    assert sum(shares.values()) == 16
    assert max(shares.values()) <= math.ceil(1.25 * 16 / 2), shares
    assert len(shares) == 2


def test_session_without_key_falls_back_to_least_outstanding() -> None:
    router = Router(RouterPolicy.SESSION)
    assert router.pick([0, 1], {0: 4, 1: 0}, 1, None) == 1


def test_tensor_parallel_replicas_keep_vllm_off_its_ray_executor() -> None:
    from rlinfer_core.types import EngineConfig
    from rlinfer_ray.replica import replica_config

    tp2 = EngineConfig(model="m", tensor_parallel_size=2)
    assert replica_config("vllm", tp2).engine_kwargs == {"distributed_executor_backend": "mp"}
    mine = EngineConfig(model="m", tensor_parallel_size=2, engine_kwargs={"distributed_executor_backend": "ray"})
    assert replica_config("vllm", mine) == mine, "the caller's choice stands"
    assert replica_config("vllm", EngineConfig(model="m")).engine_kwargs == {}
    assert replica_config("sglang", tp2) == tp2
