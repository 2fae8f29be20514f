"""Fast in-place weight loading, engine-agnostic part: one batched copy into the parameters' slices
instead of the engine's ``load_weights``.

An engine's ``load_weights`` walks the module tree in Python for every tensor and calls the
parameter's weight loader. Where a backend has verified that, for its engine and configuration,
those loaders do nothing but copy each checkpoint tensor into a slice of a parameter, it describes
the slices once (a :class:`SlicePlan`, built by an engine-specific function from the model) and
loads every update with :class:`FastLoader`: one ``torch._foreach_copy_``
into the slices. An update is loaded fast only when *every* tensor has a slice on its device in its
dtype and shape; otherwise nothing is written and the caller uses ``load_weights`` as before.

The plan keeps a name only where its slice shares no byte with another name's
(:func:`drop_overlaps`: one batched copy must write each byte once, and two names on the same
bytes mean the engine ties them), and is rebuilt when the model or any parameter's memory is
replaced (:class:`PerModel`). The engine-specific halves: ``rlinfer_vllm.worker.fast_load`` and
``rlinfer_sglang.scheduler.fast_load``. Plain torch; imports no engine.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

if TYPE_CHECKING:
    import torch

#: checkpoint name -> (dtype, shape), the tensors an engine expects in its updates
Specs = Mapping[str, "tuple[torch.dtype, tuple[int, ...]]"]

log = logging.getLogger(__name__)


class SlicePlan(NamedTuple):
    """Where each checkpoint tensor goes. ``views``: name -> the contiguous slice of a parameter
    that ``load_weights`` copies it into; ``skipped``: names ``load_weights`` ignores (a tied head);
    ``zeroed``: name -> rows ``load_weights`` zero-fills whenever it writes that name (the padding
    rows of a vocabulary padded by the engine)."""

    views: Mapping[str, torch.Tensor]
    skipped: frozenset[str] = frozenset()
    zeroed: Mapping[str, torch.Tensor] = types.MappingProxyType({})


def _byte_span(view: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, end byte) of a contiguous view."""
    size = view.element_size()
    start = int(view.storage_offset()) * size
    return view.untyped_storage().data_ptr(), start, start + int(view.numel()) * size


def drop_overlaps(views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``views`` without every name whose bytes overlap another name's (one batched copy must
    write each byte once, and two names on the same bytes mean the engine ties them)."""
    spans = sorted((*_byte_span(v), name) for name, v in views.items())
    clash: set[str] = set()
    # sorted by start: a span overlaps an earlier one iff it starts before the furthest end so far
    furthest: dict[int, tuple[int, str]] = {}
    for ptr, start, end, name in spans:
        seen = furthest.get(ptr)
        if seen is not None and start < seen[0]:
            clash.update((name, seen[1]))
        if seen is None or end > seen[0]:
            furthest[ptr] = (end, name)
    return {name: v for name, v in views.items() if name not in clash}


def parameter_storages(model: Any) -> set[int]:
    """Addresses of the storages of the model's (non-empty) parameters: a view whose storage is not
    among them is a copy or a buffer, and writing it would change nothing the engine serves."""
    return {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel() > 0}


def _fingerprint(model: Any) -> tuple[Any, ...]:
    """Changes when the model or any parameter's memory is replaced (a full reload)."""
    return (id(model), *((id(p), p.data_ptr()) for p in model.parameters()))


T = TypeVar("T")


class PerModel(Generic[T]):
    """What ``build`` makes of the model ``get_model`` returns, kept until the model or any of its
    parameters' memory is replaced (:func:`_fingerprint`, e.g. a full reload) or :meth:`invalidate`.
    ``plan_s``: seconds the last :meth:`get` spent building (0.0 when the value was kept)."""

    def __init__(self, get_model: Callable[[], Any], build: Callable[[Any], T]) -> None:
        self._get_model = get_model
        self._build = build
        self._value: tuple[T] | None = None
        self._key: tuple[Any, ...] | None = None
        self.plan_s = 0.0

    def invalidate(self) -> None:
        """Forget the value (and the references it may hold on the parameters' memory)."""
        self._value, self._key = None, None

    def get(self) -> T:
        """The value for the model as it is now."""
        import time

        model = self._get_model()
        key = _fingerprint(model)
        self.plan_s = 0.0
        if self._value is None or key != self._key:
            started = time.perf_counter()
            self.invalidate()
            self._value, self._key = (self._build(model),), key
            self.plan_s = time.perf_counter() - started
        return self._value[0]


class FastLoader:
    """The cached :class:`SlicePlan` of one engine's model, and the batched load with it.

    ``get_model`` returns the model as it is now; ``build_plan`` (engine-specific) finds the slices
    in it. The plan is rebuilt when the model or any of its parameters' memory changed since it was
    built (:func:`_fingerprint`), or after :meth:`invalidate`. A ``build_plan`` that raises means
    a layout it does not know: every update then takes ``load_weights``.
    """

    def __init__(self, get_model: Callable[[], Any], build_plan: Callable[[Any], SlicePlan]) -> None:
        self._build_plan = build_plan
        self._plan = PerModel(get_model, self._build)

    def _build(self, model: Any) -> SlicePlan:
        try:
            return self._build_plan(model)
        except Exception:
            log.warning("fast load: no plan", exc_info=True)
            return SlicePlan({})

    @property
    def plan_s(self) -> float:
        """Seconds spent building the plan at the last :meth:`views` or :meth:`load` (0.0 when cached)."""
        return self._plan.plan_s

    def invalidate(self) -> None:
        """Forget the plan (and the references it holds on the parameters' memory)."""
        self._plan.invalidate()

    def views(self) -> Mapping[str, torch.Tensor]:
        """The current views, rebuilt if the model's parameters changed."""
        return self._plan.get().views

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Copy every tensor into its slice with one ``torch._foreach_copy_``
        (and zero the rows the plan says ``load_weights`` zeroes with it) and return True, or write
        nothing and return False when some tensor has no slice on its device in its dtype and shape.
        Tensors that ``load_weights`` skips are skipped. The copies are asynchronous: the caller
        synchronizes the stream."""
        import torch

        views, skipped, zeroed = self._plan.get()
        dests, srcs, pads = [], [], []
        for name, tensor in tensors:
            if name in skipped:
                continue
            dest = views.get(name)
            if dest is None or dest.device != tensor.device or dest.dtype != tensor.dtype:
                return False
            if dest.shape != tensor.shape:
                return False
            dests.append(dest)
            srcs.append(tensor)
            pad = zeroed.get(name)
            if pad is not None:
                pads.append(pad)
        with torch.no_grad():
            if dests:
                torch._foreach_copy_(dests, srcs, non_blocking=True)
            if pads:
                torch._foreach_zero_(pads)
        return True
