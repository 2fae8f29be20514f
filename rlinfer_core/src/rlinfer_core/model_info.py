"""Facts about the served model that the facade needs to validate requests."""

from __future__ import annotations

import attrs

from rlinfer_core._validate import ints


@attrs.frozen
class ModelInfo:
    """Vocabulary size, context length and end-of-sequence ids of the served model."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = attrs.field(converter=ints, default=())
