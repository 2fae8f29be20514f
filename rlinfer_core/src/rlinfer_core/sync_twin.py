"""Blocking twins of async classes, derived member by member from the async class.

A twin (:class:`~rlinfer_core.sync_engine.Engine`, :class:`~rlinfer_core.session.Session`)
names each member of its async class once, and a helper here builds the blocking member from the
async one::

    class Engine(SyncTwin):
        generate = blocking(AsyncEngine.generate)      # coroutine -> runs on the loop thread, blocks
        stream = iterating(AsyncEngine.stream)         # async iterator -> blocking iterator
        checkpoint_names = delegated(AsyncEngine.checkpoint_names)           # plain method
        weight_version = delegated_property(AsyncEngine.weight_version)      # property
        config = Delegated[EngineConfig]()                                   # instance attribute

Every derived member calls the async object's member **of the same name** (so a subclass twin
over a subclass of the async class, e.g. the pool's, reaches the subclass's code) and carries its
name, docstring and signature (``help(Engine.generate)`` shows ``AsyncEngine.generate``'s).

Why one line per member rather than a class filled in at runtime: the helpers are typed with
``ParamSpec``, so mypy and editors see each blocking method with the async method's exact
parameters and result (``Engine.generate(requests) -> list[Completion]``), with no hand-written
stub that could drift. A class filled in by a loop would be invisible to the type checker and
would need such a stub. Completeness is checked instead: ``tests/core/test_sync_surface.py``
fails when an async class has a public member that its twin lacks or declares with other
parameters, and :meth:`SyncTwin.__init_subclass__` refuses a member derived under another name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
Y = TypeVar("Y")
A = TypeVar("A")
TwinT = TypeVar("TwinT", bound="SyncTwin")
CallT = TypeVar("CallT", bound=Callable[..., Any])

#: the attribute that marks a derived method with the async member it was derived from
SOURCE = "__sync_twin_of__"


class SyncTwin:
    """Base of a blocking twin: where its async object is and how its coroutines run."""

    def _target(self) -> Any:
        """The async object every derived member calls."""
        raise NotImplementedError

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the async object's event loop and block until it is done."""
        raise NotImplementedError

    def _iterate(self, iterator: AsyncIterator[Y]) -> Iterator[Y]:
        """Iterate ``iterator`` on the async object's event loop, blocking for each item."""
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, member in vars(cls).items():
            source = getattr(member, SOURCE, None)
            if source is None:
                continue
            if source.__name__ != name:  # the member would call the async member named `name`
                raise TypeError(f"{cls.__name__}.{name} is derived from {source.__qualname__}: the names must match")
            if member.__qualname__ == source.__qualname__:  # not yet claimed by a twin class
                member.__qualname__ = f"{cls.__qualname__}.{name}"
                member.__module__ = cls.__module__


def blocking(method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]) -> Callable[Concatenate[SyncTwin, P], R]:
    """The blocking twin of coroutine method ``method``: the coroutine is made on the caller's
    thread, run on the async object's loop thread, and its result (or error) returned."""
    if not inspect.iscoroutinefunction(method):
        raise TypeError(f"{method.__qualname__} is not a coroutine function; use delegated() or iterating()")
    name = method.__name__

    def call(twin: SyncTwin, /, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = twin._run(getattr(twin._target(), name)(*args, **kwargs))
        return result

    return _derived(call, method, inspect.signature(method).return_annotation)


def iterating(
    method: Callable[Concatenate[Any, P], AsyncIterator[Y]],
) -> Callable[Concatenate[SyncTwin, P], Iterator[Y]]:
    """The blocking twin of a method returning an async iterator: the method is called on the
    caller's thread (so its checks raise before any iteration) and its items are pulled one by
    one on the loop thread; closing (or dropping) the blocking iterator closes the async one."""
    if inspect.iscoroutinefunction(method):
        raise TypeError(f"{method.__qualname__} is a coroutine function; use blocking()")
    name = method.__name__

    def call(twin: SyncTwin, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[Y]:
        iterator: AsyncIterator[Y] = getattr(twin._target(), name)(*args, **kwargs)
        return twin._iterate(iterator)

    return _derived(call, method, _iterator_annotation(inspect.signature(method).return_annotation))


def delegated(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[SyncTwin, P], R]:
    """The twin of a plain (non-async) method: called as is, on the caller's thread."""
    if inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method):
        raise TypeError(f"{method.__qualname__} is async; use blocking() or iterating()")
    name = method.__name__

    def call(twin: SyncTwin, /, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = getattr(twin._target(), name)(*args, **kwargs)
        return result

    return _derived(call, method, inspect.signature(method).return_annotation)


def converted(
    method: Callable[Concatenate[Any, P], A], convert: Callable[[TwinT, A], R]
) -> Callable[Concatenate[TwinT, P], R]:
    """The twin of a plain method whose result is itself an async object (e.g. a session): the
    method is called on the caller's thread and ``convert(twin, result)`` makes the result's
    twin (``convert`` may be the twin class, ``Session(engine, async_session)``)."""
    name = method.__name__

    def call(twin: TwinT, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return convert(twin, getattr(twin._target(), name)(*args, **kwargs))

    returns = convert.__name__ if isinstance(convert, type) else inspect.signature(convert).return_annotation
    return _derived(call, method, returns)


def blocking_converted(
    method: Callable[Concatenate[Any, P], Coroutine[Any, Any, A]], convert: Callable[[TwinT, A], R]
) -> Callable[Concatenate[TwinT, P], R]:
    """The blocking twin of a coroutine method whose result is itself an async object (a weight
    staging): run as :func:`blocking` runs it, then ``convert(twin, result)`` makes its twin."""
    if not inspect.iscoroutinefunction(method):
        raise TypeError(f"{method.__qualname__} is not a coroutine function; use converted()")
    name = method.__name__

    def call(twin: TwinT, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return convert(twin, twin._run(getattr(twin._target(), name)(*args, **kwargs)))

    returns = convert.__name__ if isinstance(convert, type) else inspect.signature(convert).return_annotation
    return _derived(call, method, returns)


def _derived(call: CallT, method: Callable[..., Any], returns: Any) -> CallT:
    """``call`` dressed as ``method``'s twin: its name, docstring and signature (with the
    twin's result type), marked with its source for :meth:`SyncTwin.__init_subclass__`."""
    functools.update_wrapper(call, method)
    vars(call)["__signature__"] = inspect.signature(method).replace(return_annotation=returns)
    vars(call)[SOURCE] = method
    return call


def _iterator_annotation(annotation: Any) -> Any:
    """``AsyncGenerator[X, None]`` / ``AsyncIterator[X]`` (as written) -> ``Iterator[X]``."""
    if isinstance(annotation, str):
        for prefix, drop_send_type in (("AsyncGenerator[", True), ("AsyncIterator[", False)):
            if annotation.startswith(prefix) and annotation.endswith("]"):
                item = annotation[len(prefix) : -1]
                return f"Iterator[{item.rsplit(',', 1)[0] if drop_send_type else item}]"
    return inspect.Signature.empty


class Delegated(Generic[T]):
    """A twin's attribute that reads and writes the async object's attribute of the same name
    (an instance attribute such as ``config``, or a property, see :func:`delegated_property`)."""

    def __init__(self, doc: str | None = None, source: str | None = None) -> None:
        self.__doc__ = doc
        self.name = ""
        self._source = source

    def __set_name__(self, owner: type[Any], name: str) -> None:
        if self._source is not None and self._source != name:
            raise TypeError(f"{owner.__name__}.{name} is derived from {self._source!r}: the names must match")
        self.name = name
        if self.__doc__ is None:
            self.__doc__ = f"The async object's ``{name}``."

    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> Self: ...

    @overload
    def __get__(self, instance: SyncTwin, owner: type[Any] | None = None) -> T: ...

    def __get__(self, instance: SyncTwin | None, owner: type[Any] | None = None) -> Self | T:
        if instance is None:
            return self
        value: T = getattr(instance._target(), self.name)
        return value

    def __set__(self, instance: SyncTwin, value: T) -> None:
        setattr(instance._target(), self.name, value)


def delegated_property(prop: Callable[[Any], T]) -> Delegated[T]:
    """The twin of property ``prop`` (read on the async class: mypy types that read as the
    getter, so the twin's attribute gets the property's type), with its docstring."""
    getter = prop.fget if isinstance(prop, property) else prop
    if getter is None:
        raise TypeError(f"{prop!r} has no getter")
    return Delegated(prop.__doc__, getter.__name__)
