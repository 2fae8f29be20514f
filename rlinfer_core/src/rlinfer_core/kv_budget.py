"""KV-cache arithmetic from a model directory's ``config.json`` (no engine import): what one token
takes, so that a byte budget becomes a token capacity before an engine starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def hf_text_config(model: str) -> dict[str, Any] | None:
    """The language model's part of ``model``'s ``config.json`` (its ``text_config`` where there is
    one); None when ``model`` is no local directory with a readable config."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    text = data.get("text_config")
    return text if isinstance(text, dict) else data


def kv_bytes_per_token(model: str, dtype: str) -> int | None:
    """KV-cache bytes one token takes in ``model`` (a local HF directory; full attention, K and V
    in every layer), or None if unknown."""
    cfg = hf_text_config(model)
    if cfg is None:
        return None
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if dtype == "auto":
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)
