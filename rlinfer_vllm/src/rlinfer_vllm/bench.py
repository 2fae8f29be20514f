"""The raw baselines of ``rlinfer bench`` for the in-process transport: the raw engine on the same
engine instance (a component of :class:`rlinfer_vllm.transport.in_process.InProcessTransport`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlinfer_core.types import GenerateRequest

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlinfer_vllm.load_gate import LoadGate, Rpc


class RawBaseline:
    """The transport's ``bench_raw_generate`` / ``bench_raw_weight_update`` over AsyncLLM."""

    def __init__(self, alive: Callable[[], AsyncLLM], gate: LoadGate, rpc: Rpc) -> None:
        """``alive``: the running engine (or EngineDead); ``gate``: the backend's load gate;
        ``rpc``: the transport's worker call."""
        self._alive = alive
        self._gate = gate
        self._rpc = rpc

    async def generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch through AsyncLLM.generate with hand-built vLLM params; tokens out."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        llm = self._alive()
        self._gate.cache_dirty = True  # the baseline skips the gate, but fills the prefix cache

        async def one(request: GenerateRequest, index: int) -> int:
            s = request.sampling
            params = SamplingParams(
                n=1 if s.greedy else s.n,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=max(s.top_k, 0),
                seed=s.seed,
                max_tokens=s.max_tokens,
                min_tokens=s.min_tokens,
                stop_token_ids=list(s.stop_token_ids) or None,
                stop=list(s.stop) or None,
                ignore_eos=s.ignore_eos,
                logprobs=s.logprobs,
                flat_logprobs=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            last = None
            async for out in llm.generate(
                tokens_input(list(request.prompt_token_ids or ())), params, f"{request.request_id}-raw{index}"
            ):
                last = out
            copies = s.n if s.greedy else 1  # vLLM refuses greedy n>1: the n samples are one
            return 0 if last is None else copies * sum(len(o.token_ids) for o in last.outputs)

        counts = await asyncio.gather(*(one(r, i) for i, r in enumerate(requests)))
        return sum(counts)

    async def weight_update(self, path: str) -> None:
        """vLLM's own reload from disk (``reload_weights(weights_path=...)``), no validation."""
        llm = self._alive()
        resolved = str(Path(path).resolve())
        await llm.collective_rpc("reload_weights", kwargs={"weights_path": resolved})
        await self._rpc("rlinfer_shadow_from_dir", resolved)
