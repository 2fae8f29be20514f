"""Meta-tests: the kit itself covers every hook and every capability (by its markers)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from typing import Any

from rlinfer_core import hookspecs
from rlinfer_core.types import Capability

__all__ = [
    "test_every_hook_is_exercised",
    "test_every_capability_has_positive_and_negative_tests",
    "test_every_kit_test_is_exported",
]


def _suite_functions() -> Iterator[Any]:
    import rlinfer_conformance.suite as suite

    for info in pkgutil.iter_modules(suite.__path__):
        module = importlib.import_module(f"{suite.__name__}.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("test_") and fn.__module__ == module.__name__:
                yield fn


def _marks(fn: Any) -> Iterator[Any]:
    for mark in getattr(fn, "pytestmark", []):
        yield mark
        if mark.name == "parametrize":
            for value in mark.args[1]:
                yield from getattr(value, "marks", ())


def _marker_args(name: str) -> set[Any]:
    return {arg for fn in _suite_functions() for m in _marks(fn) if m.name == name for arg in m.args}


def test_every_hook_is_exercised() -> None:
    hooks = {n for n, obj in vars(hookspecs).items() if n.startswith("rlinfer_") and inspect.isfunction(obj)}
    covered = _marker_args("hooks")
    assert hooks - covered == set(), f"hooks with no kit test: {sorted(hooks - covered)}"
    assert covered - hooks == set(), f"kit tests name unknown hooks: {sorted(covered - hooks)}"


def _own_engine_capabilities() -> set[Capability]:
    """Capabilities a suite module checks on an engine it opens itself with the capability turned on
    at start (``OWN_ENGINE_CAPABILITIES``): the session's engine never claims them, so a
    ``requires`` marker (gated on that engine) would skip their positive test."""
    import rlinfer_conformance.suite as suite

    found: set[Capability] = set()
    for info in pkgutil.iter_modules(suite.__path__):
        module = importlib.import_module(f"{suite.__name__}.{info.name}")
        found |= {Capability(c) for c in getattr(module, "OWN_ENGINE_CAPABILITIES", ())}
    return found


def test_every_capability_has_positive_and_negative_tests() -> None:
    positive = {Capability(c) for c in _marker_args("requires")} | _own_engine_capabilities()
    negative = {Capability(c) for c in _marker_args("unsupported")}
    assert set(Capability) - positive == set(), f"no positive test: {sorted(set(Capability) - positive)}"
    assert set(Capability) - negative == set(), f"no negative test: {sorted(set(Capability) - negative)}"


def test_every_kit_test_is_exported() -> None:
    """A backend collects what ``from rlinfer_conformance.suite import *`` gives it: a kit test
    missing there would never run, while the marker checks above still count it."""
    import rlinfer_conformance.suite as suite

    missing = sorted(fn.__name__ for fn in _suite_functions() if getattr(suite, fn.__name__, None) is not fn)
    assert missing == [], f"kit tests not exported by rlinfer_conformance.suite: {missing}"
