"""``rlinfer bench`` hands the engine the whole EngineConfig of --config/--set/the flags (no engine)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rlinfer_core.cli import build_parser
from rlinfer_core.errors import InvalidRequest
from rlinfer_demo.bench import bench_config


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_config_file_reaches_the_engine_whole(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    config = tmp_path / "f.yaml"
    config.write_text(
        f"rollout:\n  name: vllm\n  model: {model}\n  mode: server\n  max_model_len: 256\n"
        "  engine_kwargs: {swap_space: 1}\n"
    )
    args = _args("--config", str(config), "--set", "seed=3", "--dtype", "float32", "--engine-arg", "a=1")
    backend, engine, named = bench_config(args, tmp_path)
    assert backend == "vllm" and named
    assert engine.model == str(model)
    assert engine.serving == "server" and engine.server_mode
    assert (engine.max_model_len, engine.seed, engine.dtype) == (256, 3, "float32")
    assert engine.engine_kwargs == {"swap_space": 1, "a": 1}


def test_flags_beat_the_file_and_a_tiny_model_is_made_when_none_is_named(tmp_path: Path) -> None:
    config = tmp_path / "f.toml"
    config.write_text('[rollout]\nmode = "server"\n')
    backend, engine, named = bench_config(_args("--backend", "sglang", "--config", str(config)), tmp_path)
    assert backend == "sglang" and not named
    assert (Path(engine.model) / "config.json").is_file()
    assert engine.serving == "server" and engine.seed == 0


def test_bad_values_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="mode"):
        bench_config(_args("--backend", "vllm", "--set", 'mode="remote"', "--model", "x"), tmp_path)
    with pytest.raises(InvalidRequest, match="backend"):
        bench_config(_args("--model", "x"), tmp_path)
