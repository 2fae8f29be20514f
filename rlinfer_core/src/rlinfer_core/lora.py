"""LoRA adapters (capability ``lora``): load / unload / update in place / list, and per-request use.

An adapter is loaded under a name from a PEFT directory (``adapter_config.json`` plus
``adapter_model.safetensors``) or from tensors with their PEFT config (RL with LoRA: the trainer
holds the adapter in memory). ``GenerateRequest(lora="name")`` generates with it; requests without
``lora`` use the base weights. :meth:`LoraRegistry.update` replaces an adapter's weights in place
(same name, same rank and target modules): requests admitted after it returns use the new weights
and prefix-cache entries computed with the old ones are never reused.

The facade validates adapters and keeps the registry (so an unknown ``lora`` name is an
InvalidRequest before the engine is touched); the engine work is the backend's (hooks
``rlinfer_load_lora``, ``rlinfer_unload_lora``, ``rlinfer_list_loras``).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from rlinfer_core.backend import LoraBackend
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import Capability

if TYPE_CHECKING:
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_core.types import GenerateRequest

T = TypeVar("T")

#: tensor names of a PEFT LoRA adapter end with one of these
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def _name(_inst: Any, _attr: Any, value: Any) -> None:
    if not isinstance(value, str) or not value or not value.replace("_", "a").replace("-", "a").isalnum():
        raise InvalidRequest("lora.name", f"must be a non-empty identifier ([A-Za-z0-9_-]), got {value!r}")


@attrs.frozen
class LoraAdapter:
    """An adapter to load (or the new weights of a loaded one): exactly one of ``path`` (a PEFT
    directory) and ``tensors`` (PEFT names -> tensors, with ``config`` the PEFT ``LoraConfig``
    as a dict: at least ``r``, ``lora_alpha`` and ``target_modules``)."""

    name: str = attrs.field(validator=_name)
    path: str | None = None
    tensors: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    config: Mapping[str, Any] | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.tensors is None):
            raise InvalidRequest("lora.path", "give exactly one of path (a PEFT directory) or tensors")
        if self.path is not None:
            folder = Path(self.path)
            if not (folder / "adapter_config.json").is_file():
                raise InvalidRequest(
                    "lora.path", f"{self.path!r} is not a PEFT adapter directory (no adapter_config.json)"
                )
            if not any((folder / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
                raise InvalidRequest("lora.path", f"{self.path!r} holds no adapter_model.safetensors")
            if self.config is not None:
                raise InvalidRequest("lora.config", "comes from the directory's adapter_config.json; leave it None")
        else:
            if self.config is None:
                raise InvalidRequest("lora.config", "tensors need their PEFT config (r, lora_alpha, target_modules)")
            if not self.tensors:
                raise InvalidRequest("lora.tensors", "must hold at least one tensor")
            bad = [n for n in self.tensors if not n.endswith(LORA_SUFFIXES)]
            if bad:
                raise InvalidRequest("lora.tensors", f"names must end with {LORA_SUFFIXES}, got {bad[:5]}")
        check_config(self.peft_config())

    def peft_config(self) -> Mapping[str, Any]:
        """The PEFT config (read from the directory for a path adapter)."""
        if self.config is not None:
            return self.config
        assert self.path is not None
        loaded: Mapping[str, Any] = json.loads((Path(self.path) / "adapter_config.json").read_text())
        return loaded


def check_config(config: Mapping[str, Any]) -> None:
    """Raise InvalidRequest naming ``lora.config`` unless ``config`` is a usable LoRA config."""
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidRequest("lora.config", f"r must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise InvalidRequest("lora.config", f"lora_alpha must be a number > 0, got {alpha!r}")
    targets = config.get("target_modules")
    if not targets:
        raise InvalidRequest("lora.config", "target_modules must name the modules the adapter changes")


@attrs.frozen
class LoraInfo:
    """A loaded adapter, as the engine reports it. ``version``: 0 when loaded, +1 per update."""

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    version: int = 0


def info_of(adapter: LoraAdapter, version: int = 0) -> LoraInfo:
    """The LoraInfo of ``adapter`` (from its PEFT config)."""
    config = adapter.peft_config()
    targets = config["target_modules"]
    return LoraInfo(
        adapter.name,
        int(config["r"]),
        float(config["lora_alpha"]),
        (targets,) if isinstance(targets, str) else tuple(sorted(targets)),
        version,
    )


class LoraRegistry:
    """The facade's side of LoRA for one engine: validation, names, versions, timeouts."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._loaded: dict[str, LoraInfo] = {}

    async def _call(self, what: str, call: Callable[[AsyncEngine], Awaitable[T]]) -> T:
        """``call(engine)`` (a LoRA hook reached through ``engine._calls.optional``) on an open engine,
        bounded by the request timeout."""
        engine = self._engine
        engine._calls.ensure_open()
        return await engine._calls.with_timeout(call(engine), engine.config.request_timeout_s, what)

    async def load(self, adapter: LoraAdapter) -> LoraInfo:
        """Load a new adapter under ``adapter.name``."""
        self._engine.capabilities.require(Capability.LORA)
        if adapter.name in self._loaded:
            raise InvalidRequest("lora.name", f"an adapter named {adapter.name!r} is loaded; update or unload it")
        info = info_of(adapter)
        await self._call("load_lora", lambda e: e._calls.optional(LoraBackend.rlinfer_load_lora)(adapter, False))
        self._loaded[adapter.name] = info
        return info

    async def update(self, adapter: LoraAdapter) -> LoraInfo:
        """Replace the weights of the loaded adapter ``adapter.name`` (same rank and targets)."""
        self._engine.capabilities.require(Capability.LORA)
        old = self._loaded.get(adapter.name)
        if old is None:
            raise InvalidRequest(
                "lora.name", f"no adapter named {adapter.name!r} is loaded; loaded: {sorted(self._loaded)}"
            )
        info = info_of(adapter, old.version + 1)
        if (info.rank, info.target_modules) != (old.rank, old.target_modules):
            raise InvalidRequest(
                "lora.config",
                f"an in-place update keeps rank and target modules ({old.rank}, {old.target_modules}); "
                f"got ({info.rank}, {info.target_modules}); unload and load instead",
            )
        await self._call("update_lora", lambda e: e._calls.optional(LoraBackend.rlinfer_load_lora)(adapter, True))
        self._loaded[adapter.name] = info
        return info

    async def unload(self, name: str) -> None:
        """Unload adapter ``name``; requests naming it are rejected afterwards."""
        self._engine.capabilities.require(Capability.LORA)
        if name not in self._loaded:
            raise InvalidRequest("lora.name", f"no adapter named {name!r} is loaded; loaded: {sorted(self._loaded)}")
        await self._call("unload_lora", lambda e: e._calls.optional(LoraBackend.rlinfer_unload_lora)(name))
        del self._loaded[name]

    async def list(self) -> list[LoraInfo]:
        """The loaded adapters (the engine's own list, checked against the facade's)."""
        names = set(await self._call("list_loras", lambda e: e._calls.optional(LoraBackend.rlinfer_list_loras)()))
        if names != set(self._loaded):
            raise InvalidRequest(
                "lora", f"the engine holds adapters {sorted(names)} but the facade loaded {sorted(self._loaded)}"
            )
        return [self._loaded[n] for n in sorted(names)]

    def check_request(self, request: GenerateRequest) -> None:
        """Raise InvalidRequest naming ``lora`` when a request names an adapter not loaded."""
        name = getattr(request, "lora", None)
        if name is not None and name not in self._loaded:
            raise InvalidRequest("lora", f"no adapter named {name!r} is loaded; loaded: {sorted(self._loaded)}")


_REGISTRIES: weakref.WeakKeyDictionary[Any, LoraRegistry] = weakref.WeakKeyDictionary()


def registry(engine: AsyncEngine) -> LoraRegistry:
    """The LoRA registry of ``engine`` (made on first use)."""
    found = _REGISTRIES.get(engine)
    if found is None:
        found = _REGISTRIES[engine] = LoraRegistry(engine)
    return found
