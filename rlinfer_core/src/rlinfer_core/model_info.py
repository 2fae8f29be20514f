"""Facts about the served model that the facade needs to validate requests."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from rlinfer_core._validate import ints


@attrs.frozen
class ModelInfo:
    """Vocabulary size, context length and end-of-sequence ids of the served model."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = attrs.field(converter=ints, default=())
    #: served names that are the same tensor as another HF name, e.g. ``{"lm_head.weight":
    #: "model.embed_tokens.weight"}`` for tied embeddings (updates to the second reach the first)
    tied_weights: Mapping[str, str] = attrs.field(factory=dict)
