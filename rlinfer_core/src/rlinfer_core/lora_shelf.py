"""The engine side of LoRA for backends whose engine loads adapters from PEFT directories by name.

vLLM and SGLang both load an adapter from a directory under a name and serve requests that name
it. rlinfer's in-place update (same rlinfer name, new weights) becomes a *new* engine adapter,
``<name>.v<version>`` in its own directory: requests admitted after the update use it, requests
in flight keep the old one, and the old one is removed from the engine once none uses it. Engine
prefix caches key on the adapter's name (and id), so no block computed with the old weights is
reused. :class:`AdapterShelf` keeps that bookkeeping once for every such backend; the backend
supplies how an adapter is removed from its engine.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest, RLInferError
from rlinfer_core.lora import LoraAdapter

#: PEFT config fields the engines read, with PEFT's defaults (a tensors adapter's config may omit them)
PEFT_DEFAULTS: dict[str, Any] = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "lora_dropout": 0.0,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "modules_to_save": None,
}


@attrs.define
class ServedAdapter:
    """One engine adapter: an rlinfer adapter's weights at one version, and its users in flight."""

    name: str  #: the rlinfer name requests use
    version: int  #: 0 when loaded, +1 per in-place update
    engine_id: int  #: unique per engine adapter (vLLM's ``lora_int_id``)
    folder: Path  #: the PEFT directory the engine loads
    users: int = 0
    retired: bool = False  #: replaced or unloaded; removed from the engine when ``users`` drops to 0

    @property
    def engine_name(self) -> str:
        """The name the engine knows this adapter by."""
        return f"{self.name}.v{self.version}"


def write_peft(folder: Path, adapter: LoraAdapter) -> None:
    """Make ``folder`` a PEFT directory of ``adapter`` (a link to its directory, or files written
    from its tensors and config)."""
    if adapter.path is not None:
        folder.symlink_to(Path(adapter.path).resolve(), target_is_directory=True)
        return
    from safetensors.torch import save_file

    assert adapter.tensors is not None and adapter.config is not None
    folder.mkdir(parents=True)
    config = {**PEFT_DEFAULTS, **dict(adapter.config)}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1, default=list))
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in adapter.tensors.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def _remove_folder(folder: Path) -> None:
    if folder.is_symlink():
        folder.unlink()
    else:
        shutil.rmtree(folder, ignore_errors=True)


class AdapterShelf:
    """rlinfer name -> the engine adapter serving it; versions, directories, users in flight.

    ``remove`` takes an adapter out of the engine; it is called once the adapter is retired and
    no request uses it.
    """

    def __init__(self, remove: Callable[[ServedAdapter], Awaitable[None]]) -> None:
        self._remove = remove
        self._live: dict[str, ServedAdapter] = {}
        self._ids = 0
        self._dir: Path | None = None

    def prepare(self, adapter: LoraAdapter) -> ServedAdapter:
        """A new engine adapter for ``adapter`` (next version of its name), its directory written.
        Load it into the engine, then :meth:`put` it (or :meth:`discard` it if the engine refused)."""
        old = self._live.get(adapter.name)
        self._ids += 1
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="rlinfer-lora-"))
        version = 0 if old is None else old.version + 1
        served = ServedAdapter(adapter.name, version, self._ids, self._dir / f"{adapter.name}.v{version}")
        _remove_folder(served.folder)
        write_peft(served.folder, adapter)
        return served

    @staticmethod
    def discard(served: ServedAdapter) -> None:
        """Drop the directory of an adapter the engine did not load."""
        _remove_folder(served.folder)

    async def put(self, served: ServedAdapter) -> None:
        """Serve ``served`` under its rlinfer name; the version it replaces goes once unused."""
        old = self._live.get(served.name)
        self._live[served.name] = served
        if old is not None:
            old.retired = True
            await self._release(old)

    async def unload(self, name: str) -> None:
        """Stop serving ``name``; its engine adapter goes once no request in flight uses it."""
        served = self._live.pop(name)
        served.retired = True
        await self._release(served)

    def live(self) -> Sequence[ServedAdapter]:
        """The adapters serving now."""
        return list(self._live.values())

    def acquire(self, name: str | None) -> ServedAdapter | None:
        """The adapter a request names (None for the base weights), counted as in use until
        :meth:`done`."""
        if name is None:
            return None
        served = self._live.get(name)
        if served is None:
            raise InvalidRequest("lora", f"no adapter named {name!r} is loaded; loaded: {sorted(self._live)}")
        served.users += 1
        return served

    async def done(self, served: ServedAdapter | None) -> None:
        """A request that used ``served`` ended."""
        if served is not None:
            served.users -= 1
            with contextlib.suppress(RLInferError):  # a dead engine holds no adapters to remove
                await self._release(served)

    async def _release(self, served: ServedAdapter) -> None:
        if not served.retired or served.users > 0:
            return
        try:
            await self._remove(served)
        finally:
            _remove_folder(served.folder)

    def close(self) -> None:
        """Remove every adapter directory (at shutdown)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
