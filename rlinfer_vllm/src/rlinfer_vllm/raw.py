"""``logprobs_mode="raw"`` for the vLLM backend (capability ``logprobs.raw``), per request.

vLLM's ``logprobs_mode`` is one setting per engine and rlinfer runs it ``processed_logprobs``
(what the default mode needs). Raw logprobs are ``log_softmax`` of the model's own logits, which
is exactly what vLLM's *prompt* logprobs are: so after a raw-mode request has generated, one
scoring request over ``prompt + output`` (greedy, ``max_tokens=1``, ``prompt_logprobs=k``; the
token it generates is discarded) gives the raw logprob of every output token, and its top ``k``
alternatives when the request asked for top logprobs. The sampled tokens are the engine's, drawn
from the processed distribution as usual; only the reported numbers change. Streams score each
delta over the tokens so far.

Scoring runs on the weights serving when the request ends (never under a LoRA adapter: see
:data:`rlinfer_vllm.lora.PROMPT_LOGPROBS_LORA`). Scorings in flight finish before the backend
pauses (any mode), so a pause never freezes or aborts one; a scoring started while paused runs
after resume. Raw logprobs of a request whose tokens straddle a weight update are therefore
those of the newer weights.
Cost: one prefill of ``prompt + output`` per raw request (per delta when streaming).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from rlinfer_core.errors import RLInferError
from rlinfer_core.types import Completion, GenerateRequest, LogprobsMode

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlinfer_vllm.load_gate import LoadGate
    from rlinfer_vllm.versions import TokenVersions

#: how often a pause looks whether the scorings in flight are done
DRAIN_POLL_S = 0.005


class RawLogprobs:
    """Raw-logprob scoring over one AsyncLLM; owns the count of scorings in flight."""

    def __init__(
        self,
        alive: Callable[[], AsyncLLM],
        translate: Callable[[Exception], Exception],
        gate: LoadGate,
        versions: Callable[[], TokenVersions],
    ) -> None:
        """``alive``: the running engine (or EngineDead); ``translate``: an engine error as
        rlinfer's; ``gate``: the backend's load gate; ``versions``: the started engine's token versions."""
        self._alive = alive
        self._translate = translate
        self._gate = gate
        self._versions = versions
        self._scoring = 0  #: scorings in flight

    async def score(
        self, prompt: Sequence[int], tokens: Sequence[int], start: int, top: int, lora: LoRARequest | None
    ) -> tuple[tuple[float, ...], tuple[Mapping[int, float], ...]]:
        """Raw logprobs of ``tokens[start:]`` after ``prompt + tokens[:start]`` (and the top ``top``
        alternatives at each position when ``top`` > 0)."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        llm = self._alive()
        versions = self._versions()
        params = SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=1,
            ignore_eos=True,
            prompt_logprobs=top,
            flat_logprobs=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        rid = f"rlinfer-raw-{uuid.uuid4().hex}"
        last = None
        self._scoring += 1
        try:
            async with self._gate.enter(rid):
                salt = versions.admit(rid, 1)  # a scoring prefills too (rlinfer_vllm.versions)
                scoring = tokens_input([*prompt, *tokens], cache_salt=salt)
                async for out in llm.generate(scoring, params, rid, lora_request=lora):
                    last = out
        except Exception as exc:
            raise self._translate(exc) from exc
        finally:
            self._scoring -= 1
            versions.forget(rid, 1)
        flat = None if last is None else last.prompt_logprobs
        first = len(prompt) + start
        want = len(tokens) - start
        if flat is None or len(flat.start_indices) != len(prompt) + len(tokens):
            raise RLInferError(f"vLLM scored no raw logprobs for a request of {want} tokens (aborted?)")
        values, ids = flat.logprobs, flat.token_ids
        bounds = list(zip(flat.start_indices, flat.end_indices, strict=True))[first:]
        lps = tuple(float(values[a]) for a, _ in bounds)
        tops = tuple(dict(zip(ids[a + 1 : b], values[a + 1 : b], strict=True)) for a, b in bounds) if top else ()
        return lps, tops

    async def with_raw(
        self, request: GenerateRequest, prompt: Sequence[int], done: list[Completion], lora: LoRARequest | None
    ) -> list[Completion]:
        """Completions of a raw-mode request with their logprobs replaced by raw ones."""
        if request.sampling.logprobs_mode is not LogprobsMode.RAW:
            return done
        top = request.sampling.logprobs
        scored = await asyncio.gather(*(self.score(prompt, c.token_ids, 0, top, lora) for c in done if c.token_ids))
        out, k = [], 0
        for c in done:
            if c.token_ids:
                lps, tops = scored[k]
                k += 1
                c = attrs.evolve(c, logprobs=lps, top_logprobs=tops if top else c.top_logprobs)
            out.append(c)
        return out

    async def drain(self, timeout_s: float) -> None:
        """Wait for the scorings in flight (before a pause would freeze or abort them)."""
        deadline = time.monotonic() + timeout_s
        while self._scoring and time.monotonic() < deadline:
            self._alive()
            await asyncio.sleep(DRAIN_POLL_S)


def delta_tokens(seen: dict[int, list[int]], index: int, new: Sequence[int]) -> tuple[list[int], int]:
    """A stream sample's tokens so far (``new`` appended) and where ``new`` starts."""
    so_far = seen.setdefault(index, [])
    start = len(so_far)
    so_far.extend(new)
    return list(so_far), start


__all__ = ["RawLogprobs", "delta_tokens"]
