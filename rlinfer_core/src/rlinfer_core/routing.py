"""Routing replay: the experts an MoE engine routed each token to (capability
``generate.routed_experts``), in one alignment on every backend.

**Alignment.** ``Completion.routed_experts`` of a completion with prompt ``P`` and tokens ``C``
has ``len(P) + len(C)`` rows: row ``i`` holds, per MoE layer, the ``top_k`` expert ids the
router chose when the model processed the token at position ``i`` of ``P + C`` (the forward pass
that produced the logits for position ``i + 1``). The last generated token is never fed through
the model, so its row is always :data:`MISSING`; so is any row the engine could not report.
Within a row, experts are in the engine router's order (by descending routing weight on both
engines); compare them as sets when the weights of two experts tie.

**What the engines give:**

- *prefix-cache hit*: the cached prompt positions carry the routes recorded when their KV was
  computed (both engines store routes by KV slot / KV block), so a hit returns a full array.
- *aborted request*: the routes of the positions processed before the abort; the rest
  :data:`MISSING`.
- *update mid-request*: every row is the route the weights serving at that step chose (no
  recomputation), like ``Completion.token_versions``.
- *a session's later turn*: the whole sequence of that turn's request (earlier turns' positions
  included); a trainer that already holds the earlier rows can slice.

Missing rows are :data:`MISSING` (-1) in every column.

**On the wire.** :class:`RoutedExperts` holds the array as int16 little-endian bytes (expert ids
fit: engines number at most a few hundred experts), so it crosses processes and JSON (cattrs'
base85 for bytes) cheaply and compares by value; :meth:`RoutedExperts.array` gives numpy.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core.errors import InvalidRequest

if TYPE_CHECKING:
    import numpy as np

#: the sentinel of a position without a route
MISSING = -1

_DTYPE = "<i2"

#: config.json keys that give the number of routed experts of an MoE model
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _check_data(inst: RoutedExperts, _attribute: Any, value: bytes) -> None:
    if not isinstance(value, bytes):
        raise InvalidRequest("routed_experts", f"data must be bytes, got {type(value).__name__}")
    row = 2 * inst.num_layers * inst.top_k
    if len(value) % row:
        raise InvalidRequest("routed_experts", f"{len(value)} bytes is not a whole number of {row}-byte rows")


@attrs.frozen
class RoutedExperts:
    """The routes of one completion: an int array ``[tokens, num_layers, top_k]`` (see the module
    docstring for the alignment), stored as int16 bytes."""

    num_layers: int = attrs.field(validator=attrs.validators.ge(1))
    top_k: int = attrs.field(validator=attrs.validators.ge(1))
    data: bytes = attrs.field(validator=_check_data, repr=False)

    @property
    def num_tokens(self) -> int:
        """Rows: prompt plus completion tokens."""
        return len(self.data) // (2 * self.num_layers * self.top_k)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(tokens, num_layers, top_k)``."""
        return (self.num_tokens, self.num_layers, self.top_k)

    def array(self) -> np.ndarray:
        """The routes as a numpy int16 array ``[tokens, num_layers, top_k]`` (a read-only view)."""
        import numpy as np

        return np.frombuffer(self.data, dtype=_DTYPE).reshape(self.shape)

    def tolist(self) -> list[list[list[int]]]:
        """Nested lists (JSON as is)."""
        return self.array().tolist()  # type: ignore[no-any-return]

    def missing(self) -> list[int]:
        """Positions whose row is :data:`MISSING`."""
        import numpy as np

        return [int(i) for i in np.nonzero((self.array() == MISSING).all(axis=(1, 2)))[0]]

    @classmethod
    def from_array(cls, array: Any) -> RoutedExperts:
        """From any integer array-like ``[tokens, num_layers, top_k]``."""
        import numpy as np

        a = np.asarray(array)
        if a.ndim != 3:
            raise InvalidRequest("routed_experts", f"must be [tokens, layers, top_k], got shape {a.shape}")
        return cls(num_layers=a.shape[1], top_k=a.shape[2], data=a.astype(_DTYPE).tobytes())


def aligned(rows: Any, start: int, num_tokens: int, num_layers: int, top_k: int) -> RoutedExperts:
    """The one alignment from an engine's rows: ``rows[j]`` is the route of position
    ``start + j`` (both engines report positions ``[start, prompt + output - 1)``); rows past
    ``num_tokens`` (tokens rlinfer cut, e.g. after a stop) are dropped and uncovered positions
    are :data:`MISSING`. ``rows`` may be flat (SGLang's int32 buffer) or ``[n, layers, top_k]``."""
    import numpy as np

    out = np.full((num_tokens, num_layers, top_k), MISSING, dtype=_DTYPE)
    flat = np.asarray(rows).reshape(-1)
    width = num_layers * top_k
    if flat.size % width:
        raise ValueError(f"{flat.size} route values are not whole rows of {num_layers} x {top_k}")
    got = flat.reshape(-1, num_layers, top_k)
    stop = min(num_tokens, start + len(got))
    if stop > start:
        out[start:stop] = got[: stop - start]
    return RoutedExperts.from_array(out)


def engine_rows(routes: RoutedExperts, start: int = 0) -> np.ndarray:
    """The reverse of :func:`aligned`: the engines' own layout of a completion's routes, rows for
    positions ``[start, len(P) + len(C) - 1)`` as an int32 array ``[n, num_layers, top_k]`` (SGLang's
    ``routed_experts_start_len``, vLLM's ``routed_experts_prompt_start``; the last token, never fed
    through the model, has no row; a ``start`` past it gives no rows). Rows rlinfer could not report
    stay :data:`MISSING`."""
    import numpy as np

    end = max(routes.num_tokens - 1, 0)
    return np.ascontiguousarray(routes.array()[min(max(start, 0), end) : end], dtype="<i4")


@functools.lru_cache(maxsize=64)
def moe_shape(model: str) -> tuple[int, int] | None:
    """``(num_hidden_layers, num_experts_per_tok)`` of an MoE model directory, None when the
    model has no routed experts (or its config.json cannot be read)."""
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    experts = max((int(cfg.get(k) or 0) for k in _EXPERT_KEYS), default=0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    layers = int(cfg.get("num_hidden_layers") or 0)
    if experts <= 0 or top_k <= 0 or layers <= 0:
        return None
    return layers, top_k
