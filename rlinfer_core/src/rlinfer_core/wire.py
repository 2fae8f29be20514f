"""Wire format of the contract's data types: plain JSON-ready dicts, via cattrs.

``to_wire(obj)`` turns a contract object (SamplingParams, GenerateRequest, EngineConfig,
BroadcastGroup, Completion, Capabilities, TensorSpec, ...) into dicts, lists, strings and
numbers; ``from_wire(data, cls)`` builds it back, running the class's validators, so a bad
value arriving over the wire raises :class:`~rlinfer_core.errors.InvalidRequest` like a bad
value built in-process. ``from_wire(to_wire(x), type(x)) == x`` for every valid ``x``.
Tensor-carrying weight sources are not wire types (they travel by the transfer modules).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, get_origin

import cattrs
from cattrs.errors import AttributeValidationNote
from cattrs.preconf.json import make_converter

T = TypeVar("T")


def _as_is(value: Any, _type: Any) -> Any:
    return value


def _is_literal(type_: Any) -> bool:
    return get_origin(type_) is Literal


_converter = make_converter()
# No coercion ("yes" -> True, "1.5" -> 1.5): primitives and literals pass through unchanged so
# the classes' own validators judge them and name the field and its allowed range.
for _primitive in (int, float, bool, str):
    _converter.register_structure_hook(_primitive, _as_is)
_converter.register_structure_hook_func(_is_literal, _as_is)


def to_wire(obj: Any) -> Any:
    """Unstructure ``obj`` into JSON-ready builtins (``json.dumps`` takes the result as is)."""
    return _converter.unstructure(obj)


def from_wire(data: Any, cls: type[T]) -> T:
    """Structure ``data`` (as made by :func:`to_wire`) into ``cls``; validators run.

    An :class:`~rlinfer_core.errors.InvalidRequest` raised by a validator propagates as is
    (not wrapped in a cattrs error group); any other structuring error at an attribute (e.g. a
    missing key) becomes InvalidRequest naming that attribute.
    """
    from rlinfer_core.errors import InvalidRequest

    try:
        return _converter.structure(data, cls)
    except cattrs.BaseValidationError as group:
        leaves = _leaves(group)
        for exc in leaves:
            if isinstance(exc, InvalidRequest):
                raise exc from group
        for exc in leaves:
            for note in getattr(exc, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    raise InvalidRequest(note.name, f"{type(exc).__name__}: {exc}") from group
        raise


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for exc in group.exceptions for leaf in _leaves(exc)]
    return [group]
