"""vLLM starts only with a KV cache that holds one max_model_len request: a smaller budget is
refused with UnsupportedCapability before anything loads (no engine is started here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlinfer_core.errors import UnsupportedCapability
from rlinfer_core.types import EngineConfig
from rlinfer_vllm.config import KV_BELOW_CONTEXT, engine_args


def _model(tmp_path: Path) -> str:
    # 1 KiB of KV per token in float32: K and V, 2 layers, one KV head of 64
    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_kv_budget_below_one_full_request_is_refused(tmp_path: Path) -> None:
    config = EngineConfig(model=_model(tmp_path), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(UnsupportedCapability) as raised:
        engine_args(config, "cpu")
    assert raised.value.capability == KV_BELOW_CONTEXT and "1024 tokens" in str(raised.value)


def test_a_kv_budget_that_holds_a_full_request_starts(tmp_path: Path) -> None:
    config = EngineConfig(model=_model(tmp_path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=1 << 20)
    assert engine_args(config, "cpu")["kv_cache_memory_bytes"] == 1 << 20
