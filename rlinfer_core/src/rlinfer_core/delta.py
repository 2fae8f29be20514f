"""Trainer side of delta weight sync (capability ``weights.delta``): find what changed.

    tracker = DeltaTracker(model.named_parameters(), version=engine.weight_version)
    ...  # a training step
    delta = tracker.delta(model.named_parameters())
    version = engine.update_weights(delta)
    tracker.commit(delta, version)

Comparison is exact (bit for bit) at tensor granularity: a tensor whose bytes differ in any
place is sent whole. The tracker keeps a copy of the last state the engine received (on the
tensors' own device by default, or on ``device``), so memory grows by one model copy.
Imports torch lazily.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.weights import WeightDelta

if TYPE_CHECKING:
    import torch

Named = Mapping[str, Any] | Iterable[tuple[str, Any]]


def _pairs(state: Named) -> list[tuple[str, torch.Tensor]]:
    items = state.items() if isinstance(state, Mapping) else state
    return [(str(name), tensor.detach()) for name, tensor in items]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view (NaN payloads and signed zeros compare as stored)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and bytes (``b`` may live elsewhere)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(_bits(a).equal(_bits(b.to(a.device))))


def changed_tensors(previous: Named, current: Named) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of ``current`` whose bytes differ from ``previous`` (or that
    ``previous`` lacks), in ``current``'s order; the tensors are ``current``'s own (no copy)."""
    before = dict(_pairs(previous))
    out = []
    for name, tensor in _pairs(current):
        old = before.get(name)
        if old is None or not same_bits(old, tensor):
            out.append((name, tensor))
    return out


class DeltaTracker:
    """Remembers the weights the engine serves, to send only what changed.

    ``state``: the (name, tensor) pairs the engine serves now (e.g. what was last sent in full),
    ``version``: the engine's weight version for them. ``device``: where the snapshot is kept
    (default: each tensor's own device; ``"cpu"`` saves accelerator memory but copies every
    tensor to the host on each :meth:`delta`).
    """

    def __init__(self, state: Named, version: int, device: str | None = None) -> None:
        self._device = device
        self._snapshot: dict[str, torch.Tensor] = {}
        self.version = version
        self._remember(_pairs(state))

    def _remember(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            target = tensor.device if self._device is None else self._device
            self._snapshot[name] = tensor.to(target, copy=True)

    @property
    def nbytes(self) -> int:
        """Bytes of every tracked tensor (what a full sync moves)."""
        return sum(t.numel() * t.element_size() for t in self._snapshot.values())

    def delta(self, state: Named) -> WeightDelta:
        """A :class:`~rlinfer_core.weights.WeightDelta` of ``state`` against the last committed
        state. It may be empty (nothing changed): the engine refuses an empty update, so check
        ``delta.tensors`` first."""
        current = _pairs(state)
        unknown = [name for name, _ in current if name not in self._snapshot]
        if unknown:
            raise InvalidRequest("state", f"names the tracker never saw: {unknown[:5]}")
        return WeightDelta(self.version, tuple(changed_tensors(self._snapshot, current)))

    def commit(self, delta: WeightDelta, version: int) -> None:
        """Record that the engine loaded ``delta`` and now serves ``version``."""
        if delta.base_version != self.version:
            raise InvalidRequest(
                "delta", f"base_version {delta.base_version} is not the tracked version {self.version}"
            )
        self._remember(delta.tensors)
        self.version = version

    def reset(self, state: Named, version: int) -> None:
        """Track ``state`` at ``version`` after a full update (or a discard-and-refill)."""
        self._snapshot.clear()
        self._remember(_pairs(state))
        self.version = version
