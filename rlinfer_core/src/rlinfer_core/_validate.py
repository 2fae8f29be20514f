"""attrs validators that raise InvalidRequest naming the field and the allowed range."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

MAX_INT64 = 2**63 - 1


def in_range(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    allow_none: bool = False,
    integer: bool = False,
) -> Validator:
    """Check ``low <= value <= high`` (``low < value`` with low_open); bools are rejected."""

    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and allow_none:
            return
        kinds: tuple[type, ...] = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "an integer" if integer else "a number"
            raise InvalidRequest(attribute.name, f"must be {kind}, got {value!r}")
        number = float(value)  # type: ignore[arg-type]  # checked just above
        if number != number:  # NaN
            raise InvalidRequest(attribute.name, "must not be NaN")
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
        hi = "" if high is None else f"<= {high}"
        allowed = " and ".join(x for x in (lo, hi) if x)
        if low is not None and (number <= low if low_open else number < low):
            raise InvalidRequest(attribute.name, f"must be {allowed}, got {value!r}")
        if high is not None and number > high:
            raise InvalidRequest(attribute.name, f"must be {allowed}, got {value!r}")

    return check


def one_of(*choices: Any) -> Validator:
    """Check the value is one of ``choices``."""

    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise InvalidRequest(attribute.name, f"must be one of {list(choices)}, got {value!r}")

    return check


def instance_of(kind: type | tuple[type, ...], description: str) -> Validator:
    """Check ``isinstance(value, kind)``; raise InvalidRequest (not TypeError) naming the field."""

    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, kind):
            raise InvalidRequest(attribute.name, f"must be {description}, got {value!r}")

    return check


def int_items(low: int = 0, high: int = MAX_INT64) -> Validator:
    """Check every item of a sequence is an int in ``[low, high]``."""

    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int) or not low <= item <= high:
                raise InvalidRequest(attribute.name, f"item {i} must be an integer in [{low}, {high}], got {item!r}")

    return check


def non_empty_strings(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Check every item is a non-empty string."""
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise InvalidRequest(attribute.name, f"item {i} must be a non-empty string, got {item!r}")


def ints(value: Iterable[int]) -> tuple[int, ...]:
    """Converter for shapes and id lists (typed for mypy's attrs plugin)."""
    return to_tuple(value)


def to_tuple(value: Any) -> tuple[Any, ...]:
    """Converter: lists and other iterables become tuples; a bare str/bytes is rejected later."""
    if isinstance(value, (str, bytes)):
        return (value,)
    return tuple(value)


def server_url(_inst: Any, _attribute: Any, value: Any) -> None:
    """Validator: None, or an ``http(s)://host:port`` URL naming a server only."""
    if value is None:
        return
    from urllib.parse import urlsplit

    if not isinstance(value, str):
        raise InvalidRequest("server_url", f"must be an http(s)://host:port URL or None, got {value!r}")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        port, parts = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise InvalidRequest("server_url", f"must be an http(s)://host:port URL, got {value!r}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise InvalidRequest("server_url", f"must name the server only (no path or query), got {value!r}")
