"""LoRA adapters for the SGLang backend (capability ``lora``; GPU), over SGLang's dynamic LoRA.

SGLang serves LoRA when the engine starts with ``enable_lora=True``, ``max_lora_rank`` at least
the adapters' rank and ``lora_target_modules`` (``"all"`` or module names): pass them in
``EngineConfig.engine_kwargs``. Each rlinfer load or in-place update is one SGLang adapter,
``<name>.v<version>`` loaded from its own PEFT directory
(:class:`rlinfer_core.lora_shelf.AdapterShelf`); a request names it in ``lora_path``. SGLang's
radix cache keys prefixes by adapter, so no block computed with old weights is reused.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.lora_shelf import AdapterShelf, ServedAdapter
from rlinfer_core.types import GenerateRequest
from rlinfer_sglang.transport import Transport


class LoraAdapters:
    """The adapters SGLang serves for rlinfer, and which adapter each request in flight uses."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._shelf = AdapterShelf(self._remove)
        #: request id -> the adapter its samples use, from admission to the end of the request
        self._of: dict[str, ServedAdapter] = {}

    async def _remove(self, served: ServedAdapter) -> None:
        ok, error = await self._transport.unload_lora(served.engine_name)
        if not ok:
            raise InvalidRequest("lora", f"SGLang did not unload {served.engine_name!r}: {error}")

    async def load(self, adapter: LoraAdapter) -> None:
        """Load ``adapter`` as a new SGLang adapter; its name switches to it once loaded."""
        self._transport.alive()
        served = self._shelf.prepare(adapter)
        try:
            ok, error = await self._transport.load_lora(served.engine_name, str(served.folder))
        except Exception:
            self._shelf.discard(served)
            raise
        if not ok:
            self._shelf.discard(served)
            raise InvalidRequest("lora", f"SGLang rejected adapter {adapter.name!r}: {error}")
        await self._shelf.put(served)

    async def unload(self, name: str) -> None:
        """Unload adapter ``name`` once no request in flight uses it."""
        await self._shelf.unload(name)

    def names(self) -> list[str]:
        """Names of the adapters SGLang holds and rlinfer serves."""
        held = self._transport.lora_names()
        return sorted(s.name for s in self._shelf.live() if s.engine_name in held)

    def engine_name(self, request_id: str) -> str | None:
        """SGLang's name of the adapter request ``request_id`` uses (None: the base weights)."""
        served = self._of.get(request_id)
        return None if served is None else served.engine_name

    def acquire(self, requests: Sequence[GenerateRequest]) -> None:
        """Pin the adapter each request names until :meth:`done` (all or none)."""
        taken: list[GenerateRequest] = []
        try:
            for request in requests:
                served = self._shelf.acquire(request.lora)
                if served is not None:
                    self._of[request.request_id] = served
                    taken.append(request)
        except InvalidRequest:
            for request in taken:
                self._of.pop(request.request_id).users -= 1
            raise

    async def done(self, requests: Sequence[GenerateRequest]) -> None:
        """These requests ended: unpin their adapters."""
        for request in requests:
            await self._shelf.done(self._of.pop(request.request_id, None))

    def close(self) -> None:
        """Remove the temporary adapter directories (at shutdown)."""
        self._shelf.close()
