"""Generate and stream: rlinfer requests to SGLang and its outputs back, over either transport.

:class:`Generation` owns what requests are built from: the tokenizer, priority sign and hidden
size SGLang serves, and the serialized logits processor.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs

from rlinfer_core.chat_template import prompt_ids
from rlinfer_core.errors import RLInferError
from rlinfer_core.hidden_states import hidden_size
from rlinfer_core.merge import merge
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.preflight import check_kv_room
from rlinfer_core.routing import moe_shape
from rlinfer_core.types import Completion, CompletionDelta, FinishReason, GenerateRequest, LogprobsMode
from rlinfer_sglang import images, outputs
from rlinfer_sglang import requests as bodies
from rlinfer_sglang.inflight import InFlight
from rlinfer_sglang.lora import LoraAdapters
from rlinfer_sglang.transport import Served, Transport

#: one sample: its request, its index among the request's n, its prompt ids
Sample = tuple[GenerateRequest, int, list[int]]


@attrs.define(eq=False)
class Generation:
    """Generate and stream, for the model ``model_info`` describes."""

    #: the served model's name or directory (its config.json)
    _model: str
    _transport: Transport
    _flight: InFlight
    _lora: LoraAdapters
    _model_info: Callable[[], ModelInfo]
    _tokenizer: Any = attrs.field(default=None, init=False)
    _served_hidden_size: int | None = attrs.field(default=None, init=False)
    #: rlinfer priority -> SGLang's (rlinfer_sglang.requests.priority_sign); None: no priority scheduling
    _priority_sign: int | None = attrs.field(default=None, init=False)
    _processor_str: str = attrs.field(default="", init=False)

    def started(self, served: Served) -> None:
        """Take what the started engine serves: its tokenizer, priority sign and hidden size."""
        self._tokenizer = served.tokenizer
        self._served_hidden_size = served.hidden_size
        self._priority_sign = served.priority_sign

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        info = self._model_info()
        ids = prompt_ids(self._tokenizer, request, info.max_model_len)
        ids = images.expanded_prompt(self._model, request, ids)  # as SGLang will see them
        if request.prompt_token_ids is None or request.all_images:  # the facade checked plain token ids
            check_kv_room(len(ids), request.sampling.max_tokens, info)
        return ids

    def _body(self, request: GenerateRequest, ids: list[int], rid: str, stream: bool) -> dict[str, Any]:
        """The ``GenerateReqInput`` fields of one sample (:mod:`rlinfer_sglang.requests`); built
        right after ``flight.track(rid)`` with no await between, so its cache key names the version
        its tokens start with (an update cannot land in between: see versions.py)."""
        info = self._model_info()
        params = bodies.sampling_params(request, len(ids), info.max_model_len, info.vocab_size)
        body = bodies.sample_body(
            request,
            ids,
            params,
            rid,
            self._processor(),
            stream,
            self._priority_sign,
            self._lora.engine_name(request.request_id),
            self._cache_key(self._flight.versions.started(rid)),
        )
        return {**body, **images.engine_input(self._model, request, ids)}  # input_ids (+ image_data)

    def _cache_key(self, version: int) -> str | None:
        """The ``extra_key`` of a request served by weight version ``version`` (None where the
        transport does not salt: there updates flush the cache)."""
        return bodies.cache_key(version) if self._transport.salts else None

    def _translate(self, exc: Exception) -> Exception:
        """An engine failure as rlinfer's error: EngineDead, EngineOutOfMemory where SGLang's
        message says the KV cache could not hold the request, InvalidRequest for a rejection."""
        from rlinfer_core.errors import InvalidRequest
        from rlinfer_sglang.oom import out_of_memory

        dead = self._transport.translate(exc)
        if dead is not exc:
            return dead
        oom = out_of_memory(str(getattr(exc, "detail", None) or exc), self._model_info())
        if oom is not None:  # a ValueError (in process), an HTTP 400, fastapi's HTTPException (500, 503)
            return oom
        if isinstance(exc, ValueError):
            return InvalidRequest("request", f"SGLang rejected it: {exc}")
        return exc

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Send every sample to SGLang as one batch; n completions per request, in request order.

        One batched ``GenerateReqInput`` (not one call per sample) lets SGLang's scheduler see
        the whole batch at once, exactly as a native batched ``async_generate`` call does.
        """
        self._transport.alive()
        prompts = [self._prompt_ids(r) for r in requests]
        self._lora.acquire(requests)
        try:
            return await self._generate(requests, prompts)
        finally:
            await self._lora.done(requests)

    async def _generate(self, batch: Sequence[GenerateRequest], prompts: list[list[int]]) -> list[Completion]:
        flight = self._flight
        samples = [(r, i, ids) for r, ids in zip(batch, prompts, strict=True) for i in range(r.sampling.n)]
        started = time.perf_counter()
        admitted = await flight.admit_all([r.request_id for r, _, _ in samples])
        rids = [uuid.uuid4().hex if ok else "" for ok in admitted]
        for (r, _, _), rid in zip(samples, rids, strict=True):
            if rid:
                flight.track(r.request_id, rid)
        live = [k for k, rid in enumerate(rids) if rid]
        outs: dict[int, Any] = {}
        try:
            # one priority per batched call: a call per priority, concurrently
            groups = [[live[j] for j in g] for g in bodies.priority_groups([samples[k][0] for k in live])]
            answers = await asyncio.gather(
                *(
                    self._transport.generate(
                        bodies.batch_body([self._body(samples[k][0], samples[k][2], rids[k], False) for k in group])
                    )
                    for group in groups
                )
            )
            for group, answer in zip(groups, answers, strict=True):
                outs.update(zip(group, answer if isinstance(answer, list) else [answer], strict=True))
        except asyncio.CancelledError:
            self._transport.abort_soon([rids[k] for k in live])
            raise
        except Exception as exc:
            # an engine's own failure of requests that were all aborted meanwhile is their abort
            if isinstance(exc, RLInferError) or not all(r.request_id in flight.aborted for r, _, _ in samples):
                error = self._translate(exc)
                if error is exc:
                    raise
                raise error from exc
        finally:
            for (r, _, _), rid in zip(samples, rids, strict=True):
                if rid:
                    flight.untrack(r.request_id, rid)
                    flight.release()
            flight.settle([r.request_id for r in batch], held=False)  # these requests ended
        latency = time.perf_counter() - started
        completions = [
            self._completion(r, i, ids, outs[k], rids[k], latency)
            if k in outs
            else outputs.aborted_before_output(r, i, ids, latency)
            for k, (r, i, ids) in enumerate(samples)
        ]
        for rid in rids:
            flight.versions.forget(rid)
        return await outputs.with_raw_logprobs(samples, completions, self._raw_logprobs)

    def _completion(
        self, r: GenerateRequest, i: int, ids: list[int], out: dict[str, Any], rid: str, latency: float
    ) -> Completion:
        c = outputs.completion(r, i, ids, out, latency)
        meta = out.get("meta_info") or {}
        # SGLang's own spans where the transport labels versions; else the loader's record
        versions = outputs.expand_versions(meta, len(c.token_ids)) or self._flight.versions.of(rid, len(c.token_ids))
        routes = outputs.routed_experts(r, meta, len(ids) + len(c.token_ids), moe_shape(self._model))
        prompt_states, states = outputs.hidden_states(r, meta, len(ids), len(c.token_ids), self._hidden_size(r))
        c = images.with_multimodal(self._model, r, c, meta)
        return attrs.evolve(
            c, token_versions=versions, routed_experts=routes, hidden_states=states, prompt_hidden_states=prompt_states
        )

    async def _raw_logprobs(
        self, prompt: list[int], tokens: list[int], start: int, top: int
    ) -> tuple[tuple[float, ...], tuple[dict[int, float], ...]]:
        """``log_softmax`` of the raw logits for ``tokens[start:]`` (and their top ``top``).

        SGLang reports output logprobs after its processing, so raw ones come from scoring
        ``prompt + tokens`` in one prefill: its input-token logprobs are ``log_softmax`` of the
        model's raw logits (computed by the weights serving now).
        """
        async with self._flight.scoring_prefill():
            key = self._cache_key(self._flight.versions.current)  # updates wait for scoring to end
            out = await self._transport.generate(bodies.score_body(prompt, tokens, start, top, uuid.uuid4().hex, key))
        meta = out.get("meta_info") or {}
        want = len(tokens) - start
        values = [float(e[0]) for e in list(meta.get("input_token_logprobs") or ())[-want:]]
        rows = list(meta.get("input_top_logprobs") or ())[-want:]
        tops = tuple({int(e[1]): float(e[0]) for e in row or ()} for row in rows) if top else ()
        if len(values) != want:
            raise RLInferError(f"SGLang scored {len(values)} of {want} tokens for raw logprobs")
        return tuple(values), tops

    def _hidden_size(self, request: GenerateRequest) -> int:
        """The served model's hidden size (0 when the request asks for no hidden states)."""
        if not request.sampling.return_hidden_states:
            return 0
        size = self._served_hidden_size or hidden_size(self._model)
        if not size:
            raise RLInferError(f"the hidden size of {self._model!r} is unknown (no config.json hidden_size)")
        return int(size)

    def _processor(self) -> str:
        """SGLang's serialized form of rlinfer's logits processor (built once)."""
        if not self._processor_str:
            from rlinfer_sglang.scheduler.logits import serialized

            self._processor_str = serialized()
        return self._processor_str

    async def stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Deltas of every sample, cut here from the cumulative outputs SGLang streams."""
        self._transport.alive()
        ids = self._prompt_ids(request)
        self._lora.acquire([request])
        samples = [self._stream_sample(request, i, ids) for i in range(request.sampling.n)]
        try:
            async for delta in merge(samples):
                yield delta
        finally:
            self._flight.aborted.discard(request.request_id)
            await self._lora.done([request])

    async def _stream_sample(
        self, request: GenerateRequest, index: int, ids: list[int]
    ) -> AsyncIterator[CompletionDelta]:
        flight, transport = self._flight, self._transport
        if not (await flight.admit_all([request.request_id]))[0]:
            yield CompletionDelta(request.request_id, index, (), (), FinishReason.ABORT)
            return
        rid = uuid.uuid4().hex
        flight.track(request.request_id, rid)
        seen = 0
        finished = False
        try:
            async for out in transport.stream(self._body(request, ids, rid, stream=True)):
                before = seen
                d, seen = outputs.delta(request, index, out, seen)
                flight.received[rid] = seen
                if d is None:
                    continue
                meta = out.get("meta_info") or {}
                exact = outputs.expand_versions(meta, seen) if d.finish_reason is not None else None
                versions = exact[before:seen] if exact else flight.versions.of(rid, seen, before)
                d = attrs.evolve(d, token_versions=versions)
                if request.sampling.logprobs_mode is LogprobsMode.RAW and d.token_ids:
                    so_far = [int(t) for t in out.get("output_ids") or ()][:seen]
                    lps, _ = await self._raw_logprobs(ids, so_far, before, 0)
                    d = attrs.evolve(d, logprobs=lps)
                finished = d.finish_reason is not None
                if finished and not meta.get("finish_reason"):
                    transport.abort_soon([rid])  # rlinfer ended it (stop id under ignore_eos)
                yield d
                if finished:
                    break
            if not finished:
                yield CompletionDelta(request.request_id, index, (), (), FinishReason.ABORT)
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                transport.abort_soon([rid])
            raise
        except Exception as exc:
            error = self._translate(exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            flight.untrack(request.request_id, rid)
            flight.versions.forget(rid)
            flight.release()
