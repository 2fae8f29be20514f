"""SGLang's KV limits and out-of-memory messages as rlinfer's (rlinfer_sglang.oom; no engine)."""

from __future__ import annotations

from rlinfer_core.model_info import ModelInfo
from rlinfer_sglang.oom import kv_capacity_tokens, out_of_memory

#: SGLang 0.5.23's words, as measured (1 MiB pool, tiny model, max_model_len 2048)
TOO_LONG = (
    "Input length (1100 tokens) exceeds the maximum allowed length (1018 tokens). "
    "Use a shorter input or enable --allow-auto-truncate."
)


def test_capacity_is_reported_only_where_the_pool_binds() -> None:
    assert kv_capacity_tokens(1018, 2048) == 1018  # pool of 1024 tokens, context 2048 + 5
    assert kv_capacity_tokens(511, 512) is None  # the context binds: max_model_len - 1
    assert kv_capacity_tokens(None, 512) is None


def test_messages_map_onto_out_of_memory() -> None:
    small = ModelInfo(384, 2048, kv_capacity_tokens=1018)
    oom = out_of_memory(TOO_LONG, small)
    assert oom is not None and not oom.transient and oom.capacity_tokens == 1018
    assert out_of_memory(TOO_LONG, ModelInfo(384, 512)) is None, "the context binds: an invalid request"
    retry = out_of_memory("Retracted under decode memory pressure without a KV backup. Retry later.", small)
    assert retry is not None and retry.transient
    alone = out_of_memory("Out of memory even after retracting all other requests in the decode batch.", None)
    assert alone is not None and not alone.transient
    assert out_of_memory("some other refusal", small) is None
