"""LoRA adapters for the vLLM backend (capability ``lora``), over vLLM's own LoRA support.

vLLM serves LoRA only when the engine starts with ``enable_lora=True`` (and ``max_lora_rank``
at least the adapters' rank; ``max_loras`` adapters per batch): pass them in
``EngineConfig.engine_kwargs``. The backend claims ``lora`` only on such an engine.

Each load is one vLLM adapter (``LoRARequest(name, int_id, path)``) kept by
:class:`rlinfer_core.lora_shelf.AdapterShelf`: a fresh integer id, its own vLLM name
``<name>.v<version>`` and PEFT directory; an in-place update is a new adapter, and the old one is
removed once no request in flight uses it. vLLM's prefix-cache keys include the adapter's name and
path, so no block computed with the old weights is ever reused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rlinfer_core.errors import InvalidRequest, UnsupportedCapability
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.lora_shelf import AdapterShelf, ServedAdapter
from rlinfer_core.types import Capability, GenerateRequest, LogprobsMode

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

#: why prompt logprobs (and so raw logprobs and scoring) are refused under an adapter
PROMPT_LOGPROBS_LORA = (
    "not with a LoRA adapter: vLLM 0.32 applies the adapter's logits path to prompt positions with the "
    "sampler's per-request indices, and the engine core dies (einsum shape error in punica bgmv_shrink) "
    "when such a request shares a batch with others; use the base weights for prompt/raw logprobs and score"
)


def lora_request(served: ServedAdapter | None) -> LoRARequest | None:
    """vLLM's handle of an engine adapter (None: the base weights)."""
    if served is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(served.engine_name, served.engine_id, str(served.folder))


class LoraAdapters:
    """The adapters vLLM serves for rlinfer (their :class:`AdapterShelf`), each counted as in use
    while a request runs on it."""

    def __init__(self, alive: Callable[[], AsyncLLM]) -> None:
        """``alive``: the running engine (or EngineDead)."""
        self._alive = alive
        self._shelf = AdapterShelf(self._remove)

    async def _remove(self, served: ServedAdapter) -> None:
        await self._alive().remove_lora(served.engine_id)

    async def load(self, adapter: LoraAdapter, replace: bool) -> None:
        """Load ``adapter`` as a new vLLM adapter (``replace``: and switch its name to it)."""
        llm = self._alive()
        served = self._shelf.prepare(adapter)
        try:
            added = await llm.add_lora(lora_request(served))
        except Exception as exc:
            self._shelf.discard(served)
            raise InvalidRequest("lora", f"vLLM rejected adapter {adapter.name!r}: {exc}") from exc
        if not added:
            self._shelf.discard(served)
            raise InvalidRequest("lora", f"vLLM did not load adapter {adapter.name!r}")
        await self._shelf.put(served)

    async def unload(self, name: str) -> None:
        """Unload adapter ``name`` (its vLLM adapter goes once no request in flight uses it)."""
        await self._shelf.unload(name)

    async def names(self) -> Sequence[str]:
        """Names of the adapters vLLM holds and rlinfer serves."""
        ids = await self._alive().list_loras()
        return sorted(s.name for s in self._shelf.live() if s.engine_id in ids)

    def acquire(self, request: GenerateRequest) -> ServedAdapter | None:
        """The adapter a request names, counted as in use until :meth:`done`."""
        if request.lora is not None:
            s = request.sampling
            if s.prompt_logprobs or s.logprobs_mode is LogprobsMode.RAW:
                raise UnsupportedCapability(
                    Capability.PROMPT_LOGPROBS.value if s.prompt_logprobs else Capability.LOGPROBS_RAW.value,
                    "vllm",
                    PROMPT_LOGPROBS_LORA,
                )
        return self._shelf.acquire(request.lora)

    async def done(self, served: ServedAdapter | None) -> None:
        """A request that used ``served`` (from :meth:`acquire`) ended."""
        await self._shelf.done(served)

    def close(self) -> None:
        """Remove the temporary adapter directories (at shutdown)."""
        self._shelf.close()
