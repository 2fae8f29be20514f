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
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.lora_shelf import AdapterShelf, ServedAdapter
from rlinfer_core.types import GenerateRequest
from rlinfer_sglang.base import BackendBase


class LoraHooks(BackendBase):
    """``rlinfer_load_lora`` / ``rlinfer_unload_lora`` / ``rlinfer_list_loras`` and the per-request
    adapter lookup; part of :class:`rlinfer_sglang.backend.SGLangBackend`."""

    _lora: AdapterShelf
    #: request id -> the adapter its samples use, from admission to the end of the request
    _lora_of: dict[str, ServedAdapter]

    def _lora_init(self) -> None:
        self._lora = AdapterShelf(self._lora_remove)
        self._lora_of = {}

    async def _lora_remove(self, served: ServedAdapter) -> None:
        ok, error = await self._transport.unload_lora(served.engine_name)
        if not ok:
            raise InvalidRequest("lora", f"SGLang did not unload {served.engine_name!r}: {error}")

    @hookimpl
    async def rlinfer_load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        """Load ``adapter`` as a new SGLang adapter (``replace``: and switch its name to it)."""
        self._transport.alive()
        served = self._lora.prepare(adapter)
        try:
            ok, error = await self._transport.load_lora(served.engine_name, str(served.folder))
        except Exception:
            self._lora.discard(served)
            raise
        if not ok:
            self._lora.discard(served)
            raise InvalidRequest("lora", f"SGLang rejected adapter {adapter.name!r}: {error}")
        await self._lora.put(served)

    @hookimpl
    async def rlinfer_unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (its SGLang adapter goes once no request in flight uses it)."""
        await self._lora.unload(name)

    @hookimpl
    async def rlinfer_list_loras(self) -> Sequence[str]:
        """Names of the adapters SGLang holds and rlinfer serves."""
        held = self._transport.lora_names()
        return sorted(s.name for s in self._lora.live() if s.engine_name in held)

    def _lora_acquire(self, requests: Sequence[GenerateRequest]) -> None:
        """Pin the adapter each request names until :meth:`_lora_done` (all or none)."""
        taken: list[GenerateRequest] = []
        try:
            for request in requests:
                served = self._lora.acquire(request.lora)
                if served is not None:
                    self._lora_of[request.request_id] = served
                    taken.append(request)
        except InvalidRequest:
            for request in taken:
                self._lora_of.pop(request.request_id).users -= 1
            raise

    async def _lora_done(self, requests: Sequence[GenerateRequest]) -> None:
        for request in requests:
            await self._lora.done(self._lora_of.pop(request.request_id, None))

    def _lora_cleanup(self) -> None:
        """Remove the temporary adapter directories (at shutdown)."""
        self._lora.close()
