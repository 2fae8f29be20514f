"""What the SGLang server-mode test files share: their opt-in marker and the tiny engine's fields."""

from __future__ import annotations

import os
from typing import Any

import pytest

#: server-mode tests start real SGLang servers: they run in `make test-sglang-server`
SERVER_TESTS = pytest.mark.skipif(
    os.environ.get("RLINFER_SGLANG_SERVER_TESTS") != "1",
    reason="SGLang server-mode tests run in `make test-sglang-server` (RLINFER_SGLANG_SERVER_TESTS=1)",
)

#: EngineConfig fields of the tiny test engine
FIELDS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 16,
    "request_timeout_s": 120.0,
}
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
