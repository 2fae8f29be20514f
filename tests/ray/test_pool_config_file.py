"""The ``pool:`` section of a config file -> PoolConfig, and ``rlinfer serve --replicas/--routing``
over it (parsing only: no Ray, no engine)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rlinfer_core.cli import build_parser, config_layers
from rlinfer_core.config_file import read_config_file
from rlinfer_core.errors import InvalidRequest
from rlinfer_ray import PoolConfig, RouterPolicy
from rlinfer_ray.config_file import pool_config, pool_from_file
from rlinfer_server.cli import pool_settings


def _file(tmp_path: Path, text: str, name: str = "f.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--backend", "vllm", "--model", "m", *argv])


def test_the_section_structures_into_pool_config(tmp_path: Path) -> None:
    path = _file(tmp_path, "rollout: {name: vllm}\npool: {replicas: 3, policy: session, cpus_per_replica: 2}\n")
    assert read_config_file(path).pool == {"replicas": 3, "policy": "session", "cpus_per_replica": 2}
    pool = pool_from_file(path)
    assert pool == PoolConfig(replicas=3, policy=RouterPolicy.SESSION, cpus_per_replica=2.0)
    toml = _file(tmp_path, '[pool]\nrouting = "round_robin"\n', "f.toml")
    assert pool_from_file(toml).policy is RouterPolicy.ROUND_ROBIN  # `routing`: the flag's alias of `policy`


@pytest.mark.parametrize(
    ("section", "field", "needle"),
    [
        ("{replicas: 2, replica: 3}", "replica", "allowed keys: ['accelerator'"),
        ("{routing: fastest}", "policy", "'least_outstanding', 'round_robin', 'session'"),
        ("{policy: fastest}", "policy", "got 'fastest'"),
        ("{replicas: '2'}", "replicas", "must be an integer"),
        ("{replicas: 0}", "replicas", ">= 1"),
        ("{accelerator: tpu}", "accelerator", "allowed values: ['auto', 'cpu', 'gpu']"),
        ("{retry: 'yes'}", "retry", "true or false"),
        ("{routing: session, policy: session}", "policy", "given twice"),
        ("[1, 2]", "pool", "must be a mapping"),
    ],
)
def test_bad_keys_and_values_name_the_key_and_the_file(tmp_path: Path, section: str, field: str, needle: str) -> None:
    path = _file(tmp_path, f"pool: {section}\n")
    with pytest.raises(InvalidRequest) as info:
        pool_from_file(path)
    assert info.value.field == field
    assert needle in str(info.value)
    if field != "pool":
        assert f"{path} [pool]" in str(info.value)


def test_flags_override_the_section(tmp_path: Path) -> None:
    path = _file(tmp_path, "pool: {replicas: 3, policy: session, max_retries: 5}\n")
    pool = pool_config(read_config_file(path), {"replicas": 1, "routing": "round_robin", "spread_n": None})
    assert (pool.replicas, pool.policy, pool.max_retries) == (1, RouterPolicy.ROUND_ROBIN, 5)
    with pytest.raises(InvalidRequest, match="the command line") as info:
        pool_config(read_config_file(path), {"replicas": -1})
    assert info.value.field == "replicas"


def test_serve_opens_a_pool_only_when_asked(tmp_path: Path) -> None:
    plain = _file(tmp_path, "rollout: {name: vllm}\n", "plain.yaml")
    pooled = _file(tmp_path, "rollout: {name: vllm}\npool: {replicas: 3, policy: session}\n", "pooled.yaml")

    def settings(*argv: str) -> PoolConfig | None:
        args = _serve(*argv)
        file_settings, _ = config_layers(args)
        result: PoolConfig | None = pool_settings(args, file_settings)
        return result

    assert settings() is None
    assert settings("--config", str(plain)) is None
    assert settings("--replicas", "2") == PoolConfig(replicas=2)
    assert settings("--config", str(pooled)) == PoolConfig(replicas=3, policy=RouterPolicy.SESSION)
    over = settings("--config", str(pooled), "--replicas", "1", "--routing", "round_robin")
    assert over == PoolConfig(replicas=1, policy=RouterPolicy.ROUND_ROBIN)
    with pytest.raises(InvalidRequest) as info:
        settings("--routing", "session")
    assert info.value.field == "routing"
    with pytest.raises(InvalidRequest) as info:
        settings("--replicas", "0")
    assert info.value.field == "replicas"


def test_bench_replicas_reads_the_section(tmp_path: Path) -> None:
    from rlinfer_demo.bench import bench_pool_config

    path = _file(tmp_path, "rollout: {name: vllm}\npool: {replicas: 3, policy: session, cpus_per_replica: 0.5}\n")
    args = build_parser().parse_args(["bench", "--config", str(path), "--replicas", "2"])
    assert bench_pool_config(args, 2) == PoolConfig(replicas=2, policy=RouterPolicy.SESSION, cpus_per_replica=0.5)
    assert bench_pool_config(build_parser().parse_args(["bench", "--replicas", "1"]), 1) == PoolConfig(replicas=1)
    bad = _file(tmp_path, "pool: {routing: nearest}\n", "bad.yaml")
    with pytest.raises(InvalidRequest, match=r"bad\.yaml"):
        bench_pool_config(build_parser().parse_args(["bench", "--config", str(bad), "--replicas", "2"]), 2)
