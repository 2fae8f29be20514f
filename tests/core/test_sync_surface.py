"""The blocking twins have the surface of their async classes (issue 24): every public member of
AsyncEngine / AsyncSession has a counterpart of the same name and parameters on Engine / Session
(a pool is an AsyncEngine over rlinfer_ray's PoolBackend, so Engine is its twin too), every
derived member of a twin names a member of its async class, and the conformance kit uses only
the sync surface (never ``.async_engine``)."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import sys
import textwrap
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest

from rlinfer_core.engine import AsyncEngine, Engine
from rlinfer_core.errors import EngineDead
from rlinfer_core.session import AsyncSession, Session
from rlinfer_core.sync_twin import SOURCE, Delegated, SyncTwin, blocking, delegated, delegated_property, iterating

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "conformance" / "src" / "rlinfer_conformance"
T = TypeVar("T")

#: marks a public attribute that the async class sets on its instances (no class member)
INSTANCE = object()
#: the async context manager's methods and their blocking twins
CONTEXT = {"__aenter__": "__enter__", "__aexit__": "__exit__"}


def instance_attributes(cls: type) -> set[str]:
    """Public ``self.<name> = ...`` targets of the ``__init__`` of ``cls`` and its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            names.update(
                t.attr
                for t in targets
                if isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
                and not t.attr.startswith("_")
            )
    return names


def public_surface(cls: type) -> dict[str, Any]:
    """Public members of ``cls`` as stored (descriptors not invoked), and its instance attributes."""
    members: dict[str, Any] = dict.fromkeys(instance_attributes(cls), INSTANCE)
    for klass in reversed(cls.__mro__[:-1]):
        members.update({name: value for name, value in vars(klass).items() if not name.startswith("_")})
    return members


def parameters(cls: type, name: str) -> list[tuple[str, Any, Any, Any]]:
    """The parameters of method ``name`` as a caller passes them (without self / cls)."""
    member = inspect.getattr_static(cls, name)
    signature = inspect.signature(getattr(cls, name))  # a classmethod comes bound, without cls
    params = list(signature.parameters.values())
    if not isinstance(member, classmethod | staticmethod):
        params = params[1:]
    return [(p.name, p.kind, p.default, p.annotation) for p in params]


def is_attribute(member: Any) -> bool:
    """A property, a delegated attribute, or an instance attribute."""
    return member is INSTANCE or inspect.isdatadescriptor(member)


def twin_problems(async_cls: type, sync_cls: type) -> list[str]:
    """How ``sync_cls`` is not the blocking twin of ``async_cls`` (empty when it is)."""
    problems = []
    sync_surface = public_surface(sync_cls)
    for name, member in sorted(public_surface(async_cls).items()):
        if name not in sync_surface:
            problems.append(f"{sync_cls.__name__} lacks {name!r}")
            continue
        counterpart = sync_surface[name]
        if is_attribute(member):
            if not is_attribute(counterpart):
                problems.append(f"{sync_cls.__name__}.{name} is not an attribute, as {async_cls.__name__}'s is")
        elif is_attribute(counterpart) or not callable(getattr(sync_cls, name)):
            problems.append(f"{sync_cls.__name__}.{name} is not a method, as {async_cls.__name__}'s is")
        elif inspect.iscoroutinefunction(counterpart) or inspect.isasyncgenfunction(counterpart):
            problems.append(f"{sync_cls.__name__}.{name} is async")
        elif parameters(async_cls, name) != parameters(sync_cls, name):
            problems.append(
                f"{sync_cls.__name__}.{name}{inspect.signature(getattr(sync_cls, name))} takes other parameters "
                f"than {async_cls.__name__}.{name}{inspect.signature(getattr(async_cls, name))}"
            )
    for async_name, sync_name in CONTEXT.items():
        if hasattr(async_cls, async_name) and not hasattr(sync_cls, sync_name):
            problems.append(f"{sync_cls.__name__} lacks {sync_name} ({async_cls.__name__} has {async_name})")
    for name in dir(sync_cls):  # derived members (inherited ones too) call the async member of their name
        member = inspect.getattr_static(sync_cls, name)
        derived = isinstance(member, Delegated) or getattr(member, SOURCE, None) is not None
        if derived and not hasattr(async_cls, name) and name not in instance_attributes(async_cls):
            problems.append(
                f"{sync_cls.__name__}.{name} delegates to {async_cls.__name__}.{name}, which does not exist"
            )
    return problems


def test_engine_is_the_twin_of_async_engine() -> None:
    assert twin_problems(AsyncEngine, Engine) == []


def test_session_is_the_twin_of_async_session() -> None:
    assert twin_problems(AsyncSession, Session) == []


def import_pool_backend() -> type:
    """rlinfer_ray's PoolBackend (the core env has Ray but not rlinfer_ray installed: then from the source tree)."""
    pytest.importorskip("ray", reason="rlinfer_ray's pool runs on Ray, which is not importable in this environment")
    try:
        pool = importlib.import_module("rlinfer_ray.pool")
    except ModuleNotFoundError:
        # the repository root on sys.path makes `rlinfer_ray` an empty namespace package there
        sys.modules.pop("rlinfer_ray", None)
        sys.path.insert(0, str(REPO / "rlinfer_ray" / "src"))
        pool = importlib.import_module("rlinfer_ray.pool")
    backend: type = pool.PoolBackend
    return backend


# --- the check itself can fail ----------------------------------------------------------------------


class _Async:
    def __init__(self) -> None:
        self.label = "async"
        self._closed = False
        self._threads: list[str] = []

    @property
    def version(self) -> int:
        """The version."""
        return 7

    async def go(self, x: int, *, y: str = "") -> str:
        """Go somewhere."""
        self._threads.append(threading.current_thread().name)
        return f"{x}{y}"

    async def items(self, n: int) -> AsyncGenerator[int, None]:
        try:
            for i in range(n):
                yield i
        finally:
            self._closed = True

    def plain(self) -> str:
        return threading.current_thread().name


class _Twin(SyncTwin):
    label = Delegated[str]()
    version = delegated_property(_Async.version)
    go = blocking(_Async.go)
    items = iterating(_Async.items)
    plain = delegated(_Async.plain)


class _RunningTwin(_Twin, Engine):
    """The toy twin on the sync Engine's loop thread (its _run and _iterate)."""


def test_the_check_finds_missing_members_other_parameters_and_other_names() -> None:
    assert twin_problems(_Async, _Twin) == []
    problems = twin_problems(_Async, type("Loose", (SyncTwin,), {"go": _Twin.go}))
    assert "Loose lacks 'version'" in problems and "Loose lacks 'label'" in problems, problems

    def go(self: Any, x: int) -> str:  # a hand-written twin that forgot y
        return ""

    problems = twin_problems(_Async, type("HandWritten", (_Twin,), {"go": go}))
    assert any(p.startswith("HandWritten.go(") and "takes other parameters" in p for p in problems), problems
    problems = twin_problems(type("Smaller", (), {"go": _Async.go}), _Twin)
    assert "_Twin.plain delegates to Smaller.plain, which does not exist" in problems, problems
    with pytest.raises(TypeError, match="names must match"):
        type("Renamed", (SyncTwin,), {"stop": blocking(_Async.go)})
    with pytest.raises((TypeError, RuntimeError)):  # 3.11 wraps __set_name__'s error in RuntimeError
        type("Renamed", (SyncTwin,), {"release": delegated_property(_Async.version)})


def test_derived_members_block_iterate_and_delegate() -> None:
    async def start() -> _Async:
        return _Async()

    twin = _RunningTwin._open_on_loop(start, "twin-loop")
    inner: _Async = twin._target()  # type: ignore[assignment]
    try:
        assert twin.go(1, y="a") == "1a" and inner._threads == ["twin-loop"]
        assert twin.plain() == threading.current_thread().name  # plain methods run on the caller's thread
        assert twin.version == 7 and twin.label == "async"
        twin.label = "set"
        assert inner.label == "set"
        assert list(twin.items(3)) == [0, 1, 2] and inner._closed
        inner._closed = False
        iterator = twin.items(5)
        assert next(iterator) == 0
        iterator.close()  # closing early closes the async generator, on the loop
        assert inner._closed
        assert _Twin.go.__doc__ == "Go somewhere." and _Twin.go.__qualname__ == "_Twin.go"
        assert str(inspect.signature(_Twin.items)).endswith("-> 'Iterator[int]'")
        assert _Twin.version.__doc__ == "The version."
    finally:
        twin._loop.call_soon_threadsafe(twin._loop.stop)
        twin._thread.join(timeout=10)


def test_a_shut_down_engine_refuses_sync_calls() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    engine = Engine(SimpleNamespace(backend_name="toy"), loop, thread)  # type: ignore[arg-type]
    with pytest.raises(EngineDead):
        engine._run(asyncio.sleep(0))
    loop.close()


# --- the kit ------------------------------------------------------------------------------------------


def test_the_kit_uses_only_the_sync_surface() -> None:
    uses = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted(KIT.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "async_engine" in line
    ]
    assert not uses, "the conformance kit reaches into the async engine; use the sync Engine's members:\n" + "\n".join(
        uses
    )
