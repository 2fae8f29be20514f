"""Facts about the served model that the facade needs to validate requests."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from rlinfer_core._validate import ints


@attrs.frozen
class ModelInfo:
    """Vocabulary size, context length and end-of-sequence ids of the served model, and the KV
    cache's room for one request where it is smaller than the context."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = attrs.field(converter=ints, default=())
    #: served names that are the same tensor as another HF name, e.g. ``{"lm_head.weight":
    #: "model.embed_tokens.weight"}`` for tied embeddings (updates to the second reach the first)
    tied_weights: Mapping[str, str] = attrs.field(factory=dict)
    #: the most tokens (prompt + output) one request can hold in the engine's KV cache, read from
    #: the engine at start; set only where it is smaller than max_model_len (an engine may start
    #: with a KV budget below one full-length request). The facade refuses a request whose prompt
    #: plus max_tokens (capped at max_model_len) exceeds it with EngineOutOfMemory.
    kv_capacity_tokens: int | None = None
