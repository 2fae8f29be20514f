"""Hidden states out (capability ``generate.hidden_states``): the model's final-layer hidden
state (after the final norm, the input of the LM head) at the positions of a completion, for
value heads and process rewards.

**Alignment.** For a completion with prompt ``P`` and tokens ``C``:

- ``Completion.hidden_states`` (``SamplingParams.return_hidden_states``) has ``len(C)`` rows:
  row ``i`` is the state at position ``len(P) + i - 1`` of ``P + C``, the one whose LM-head
  logits gave token ``i`` (and its logprob). This is what PPO value heads read (TRL and verl
  take ``values[:, -len(C) - 1 : -1]`` of a forward over ``P + C``). The state at the last
  generated token is never computed by an engine (that token is not fed back), so it is not here.
- ``Completion.prompt_hidden_states`` (``SamplingParams.prompt_hidden_states``) has ``len(P)``
  rows: row ``j`` is the state at prompt position ``j``. Its last row is the first row of
  ``hidden_states``.

Rows an engine could not report are NaN (none on a backend that claims the capability, unless
the request was aborted: then only the rows of the tokens it returned exist anyway).

**On the wire.** :class:`HiddenStates` holds the array as float32 little-endian bytes, so it
crosses processes and JSON (cattrs' base85 for bytes) and compares by value;
:meth:`HiddenStates.array` gives numpy.
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

_DTYPE = "<f4"


def _check_data(inst: HiddenStates, _attribute: Any, value: bytes) -> None:
    if not isinstance(value, bytes):
        raise InvalidRequest("hidden_states", f"data must be bytes, got {type(value).__name__}")
    row = 4 * inst.hidden_size
    if len(value) % row:
        raise InvalidRequest("hidden_states", f"{len(value)} bytes is not a whole number of {row}-byte rows")


@attrs.frozen
class HiddenStates:
    """Final-layer hidden states of a completion: a float32 array ``[rows, hidden_size]`` (see
    the module docstring for which positions the rows are), stored as bytes."""

    hidden_size: int = attrs.field(validator=attrs.validators.ge(1))
    data: bytes = attrs.field(validator=_check_data, repr=False)

    @property
    def num_rows(self) -> int:
        """Rows (positions)."""
        return len(self.data) // (4 * self.hidden_size)

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, hidden_size)``."""
        return (self.num_rows, self.hidden_size)

    def array(self) -> np.ndarray:
        """The states as a numpy float32 array ``[rows, hidden_size]`` (a read-only view)."""
        import numpy as np

        return np.frombuffer(self.data, dtype=_DTYPE).reshape(self.shape)

    def tolist(self) -> list[list[float]]:
        """Nested lists (JSON as is; NaN rows stay NaN)."""
        return self.array().tolist()  # type: ignore[no-any-return]

    def missing(self) -> list[int]:
        """Rows the engine could not report (NaN)."""
        import numpy as np

        return [int(i) for i in np.nonzero(np.isnan(self.array()).all(axis=1))[0]]

    @classmethod
    def from_array(cls, array: Any) -> HiddenStates:
        """From any float array-like ``[rows, hidden_size]`` (cast to float32)."""
        import numpy as np

        a = np.asarray(array, dtype=np.float32)
        if a.ndim != 2 or a.shape[1] < 1:
            raise InvalidRequest("hidden_states", f"must be [rows, hidden_size], got shape {a.shape}")
        return cls(hidden_size=a.shape[1], data=a.astype(_DTYPE).tobytes())


def split_positions(
    rows: Any, start: int, prompt_len: int, output_len: int, hidden_size: int, with_prompt: bool
) -> tuple[HiddenStates | None, HiddenStates]:
    """``(prompt_hidden_states, hidden_states)`` from an engine's rows, ``rows[k]`` being the state
    at position ``start + k`` of prompt + output. Positions without a row are NaN; rows past the
    last position a completion uses (``prompt_len + output_len - 2``: e.g. tokens rlinfer cut
    after a stop) are dropped. The prompt part is None unless ``with_prompt``."""
    import numpy as np

    got = np.asarray(rows, dtype=np.float32).reshape(-1, hidden_size) if len(rows) else np.empty((0, hidden_size))
    positions = np.full((prompt_len + max(output_len - 1, 0), hidden_size), np.nan, dtype=np.float32)
    begin, stop = max(start, 0), min(start + len(got), len(positions))
    if stop > begin:
        positions[begin:stop] = got[begin - start : stop - start]
    output = positions[prompt_len - 1 : prompt_len - 1 + output_len]
    prompt = HiddenStates.from_array(positions[:prompt_len]) if with_prompt else None
    return prompt, HiddenStates.from_array(output.reshape(-1, hidden_size))


@functools.lru_cache(maxsize=64)
def hidden_size(model: str) -> int | None:
    """``hidden_size`` of the model directory's config.json (None when it cannot be read)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    size = int(cfg.get("hidden_size") or 0)
    return size if size > 0 else None
