"""Observer plugins: they watch an engine and can never change what it does.

Observers implement only the ``rlinfer_on_...`` event hooks of :mod:`rlinfer_core.hookspecs`. They
live in their own :class:`pluggy.PluginManager`, apart from the backend's operation hooks, so an
observer that implements ``rlinfer_generate`` cannot win over the backend: it is refused at
registration. Each observer is called on its own, and an exception it raises is logged and
swallowed: a broken metrics plugin never turns a successful weight update into a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pluggy

from rlinfer_core import hookspecs
from rlinfer_core.errors import InvalidRequest

logger = logging.getLogger(__name__)

EVENT_PREFIX = "rlinfer_on_"


def operation_hooks_of(pm: pluggy.PluginManager, plugin: Any) -> list[str]:
    """Names of rlinfer hooks ``plugin`` implements that are not event hooks."""
    names = []
    for attr in dir(plugin):
        is_operation = attr.startswith(hookspecs.PROJECT + "_") and not attr.startswith(EVENT_PREFIX)
        if is_operation and pm.parse_hookimpl_opts(plugin, attr) is not None:
            names.append(attr)
    return names


class Observers:
    """The observer plugins of one engine, and a safe way to tell them about events."""

    def __init__(self, plugins: Iterable[Any] = (), entry_point_plugins: Iterable[Any] = ()) -> None:
        self._pm = hookspecs.PluginManager()
        for plugin in entry_point_plugins:
            refused = operation_hooks_of(self._pm, plugin)
            if refused:  # one bad installed plugin must not stop every engine
                logger.warning("observer plugin %r refused: it implements operation hooks %s", plugin, refused)
                continue
            self._pm.register(plugin)
        for plugin in plugins:
            refused = operation_hooks_of(self._pm, plugin)
            if refused:
                raise InvalidRequest(
                    "plugins",
                    f"observer {plugin!r} implements operation hooks {refused}; observers may implement "
                    f"only {EVENT_PREFIX}* event hooks (a backend is registered by entry point instead)",
                )
            self._pm.register(plugin)
        self._pm.check_pending()

    def emit(self, event: str, **kwargs: Any) -> None:
        """Call every observer's ``event`` hook; log and swallow what they raise."""
        caller = getattr(self._pm.hook, event)
        for impl in reversed(caller.get_hookimpls()):
            try:
                impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception:
                logger.exception("observer %r failed in %s; ignored", impl.plugin_name, event)
