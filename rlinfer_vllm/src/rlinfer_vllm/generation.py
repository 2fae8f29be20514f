"""Generation of the in-process transport (a component of
:class:`rlinfer_vllm.transport.in_process.InProcessTransport`): batches and streams through
``AsyncLLM.generate``, with token versions, raw logprobs (:class:`rlinfer_vllm.raw.RawLogprobs`),
images and LoRA adapters (:class:`rlinfer_vllm.lora.LoraAdapters`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core.chat_template import prompt_ids
from rlinfer_core.errors import UnsupportedCapability
from rlinfer_core.types import (
    Capability,
    Completion,
    CompletionDelta,
    FinishReason,
    GenerateRequest,
    LogprobsMode,
)
from rlinfer_vllm import engine_io
from rlinfer_vllm import images as image_inputs
from rlinfer_vllm.batch import complete_all
from rlinfer_vllm.lora import lora_request
from rlinfer_vllm.raw import delta_tokens

if TYPE_CHECKING:
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlinfer_vllm.load_gate import LoadGate
    from rlinfer_vllm.lora import LoraAdapters
    from rlinfer_vllm.raw import RawLogprobs
    from rlinfer_vllm.versions import TokenVersions


class Generation:
    """``generate`` / ``stream`` of :class:`rlinfer_vllm.transport.in_process.InProcessTransport`."""

    def __init__(
        self,
        model: str,
        alive: Callable[[], AsyncLLM],
        translate: Callable[[Exception], Exception],
        versions: Callable[[], TokenVersions],
        max_len: Callable[[], int],
        inflight: set[str],
        gate: LoadGate,
        lora: LoraAdapters,
        raw: RawLogprobs,
    ) -> None:
        """``model``: the served model (its processor places images); ``alive``: the running engine
        (or EngineDead); ``translate``: an engine error as rlinfer's; ``versions``, ``max_len``: the
        started engine's token versions and context length; ``inflight``: the backend's request ids
        in the engine (added and discarded here); ``gate``: the backend's load gate; ``lora``: the
        served adapters; ``raw``: the raw-logprob scorer."""
        self._model = model
        self._alive = alive
        self._translate = translate
        self._versions = versions
        self._max_len = max_len
        self._inflight = inflight
        self._gate = gate
        self._lora = lora
        self._raw = raw

    def _prompt_ids(self, llm: AsyncLLM, request: GenerateRequest) -> list[int]:
        return prompt_ids(llm.tokenizer, request, self._max_len())

    def _engine_prompt(self, request: GenerateRequest, ids: list[int]) -> tuple[Any, int]:
        """vLLM's prompt for ``ids`` (with the request's images, placeholders expanded once by
        vLLM: :mod:`rlinfer_vllm.images`) and its length as served."""
        from vllm.inputs.engine import tokens_input

        images = request.all_images
        if not images:
            return tokens_input(ids), len(ids)
        if request.sampling.logprobs_mode is LogprobsMode.RAW:
            raise UnsupportedCapability(
                Capability.LOGPROBS_RAW.value, "vllm", "raw logprobs are scored by a text-only prefill: not with images"
            )
        return image_inputs.engine_prompt(self._model, ids, images)

    def _with_images(self, request: GenerateRequest, done: list[Completion]) -> list[Completion]:
        images = request.all_images
        if not images or not done:
            return done
        info = image_inputs.multimodal_info(self._model, done[0].prompt_token_ids, images)
        return [attrs.evolve(c, multimodal=info) for c in done]

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Run every request concurrently; n completions per request, in request order."""
        self._alive()
        return await complete_all(requests, self._complete)

    def _engine_request(
        self, request: GenerateRequest, kind: RequestOutputKind
    ) -> tuple[AsyncLLM, list[int], Any, SamplingParams, TokenVersions]:
        """The engine, the prompt ids, vLLM's prompt (salted only at admission:
        :mod:`rlinfer_vllm.versions`) and sampling parameters, and the token versions."""
        llm = self._alive()
        ids = self._prompt_ids(llm, request)
        prompt, prompt_len = self._engine_prompt(request, ids)
        params = engine_io.sampling_params(request, prompt_len, self._max_len(), kind)
        return llm, ids, prompt, params, self._versions()

    async def _complete(self, request: GenerateRequest) -> list[Completion]:
        from vllm.sampling_params import RequestOutputKind

        llm, ids, prompt, params, versions = self._engine_request(request, RequestOutputKind.FINAL_ONLY)
        started = time.perf_counter()
        last = None
        served = self._lora.acquire(request)
        lora = lora_request(served)
        try:
            self._inflight.add(request.request_id)
            try:
                async with self._gate.enter(request.request_id) as entry:
                    if entry.admitted:
                        # the salt of the version live at admission (rlinfer_vllm.versions)
                        salted = {**prompt, "cache_salt": versions.admit(request.request_id, params.n)}
                        async for out in llm.generate(
                            salted, params, request.request_id, lora_request=lora, priority=request.priority
                        ):
                            last = out
            except Exception as exc:
                raise self._translate(exc) from exc
            finally:
                self._inflight.discard(request.request_id)
            latency = time.perf_counter() - started
            if last is None:
                versions.forget(request.request_id, params.n)
                return engine_io.aborted_before_output(request, ids, latency)
            done = [
                attrs.evolve(c, token_versions=versions.take(request.request_id, c.index, len(c.token_ids)))
                for c in engine_io.completions(request, last, latency)
            ]
            versions.forget(request.request_id, params.n)
            done = self._with_images(request, done)
            return engine_io.replicate(request, await self._raw.with_raw(request, ids, done, lora))
        finally:
            await self._lora.done(served)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream deltas (vLLM's DELTA output kind); the last one of each sample has its finish reason."""
        from vllm.sampling_params import RequestOutputKind

        llm, ids, prompt, params, versions = self._engine_request(request, RequestOutputKind.DELTA)
        served = self._lora.acquire(request)
        lora = lora_request(served)
        raw = request.sampling.logprobs_mode is LogprobsMode.RAW
        seen: dict[int, list[int]] = {}
        self._inflight.add(request.request_id)
        try:
            async with self._gate.enter(request.request_id) as entry:
                if not entry.admitted:  # aborted while a weight load held it back
                    for index in range(request.sampling.n):
                        yield CompletionDelta(
                            request.request_id, index, (), (), FinishReason.ABORT, None, versions.version, ()
                        )
                    return
                salted = {**prompt, "cache_salt": versions.admit(request.request_id, params.n)}
                async for out in llm.generate(
                    salted, params, request.request_id, lora_request=lora, priority=request.priority
                ):
                    if out.finished:  # ended in the engine; the consumer may read it later
                        self._inflight.discard(request.request_id)
                        entry.done()
                    for o in out.outputs:
                        finished = o.finish_reason is not None
                        if o.token_ids or finished:
                            delta = engine_io.delta(request.request_id, o, finished)
                            stamps = versions.take(request.request_id, o.index, len(delta.token_ids))
                            delta = attrs.evolve(delta, token_versions=stamps)
                            if raw and delta.token_ids:
                                so_far, start = delta_tokens(seen, o.index, delta.token_ids)
                                lps, _ = await self._raw.score(ids, so_far, start, 0, lora)
                                delta = attrs.evolve(delta, logprobs=lps)
                            for item in engine_io.replicate(request, [delta]):
                                yield item
        except Exception as exc:
            raise self._translate(exc) from exc
        finally:
            self._inflight.discard(request.request_id)
            versions.forget(request.request_id, params.n)
            await self._lora.done(served)
