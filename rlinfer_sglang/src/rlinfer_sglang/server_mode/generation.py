"""Generate and stream over SGLang's ``/generate`` (token ids in, token ids and logprobs out).

As in-process (:mod:`rlinfer_sglang.generation`): every sample of a batch goes in one batched
``/generate`` call, so the scheduler sees the whole batch at once; raw logprobs come from one
scoring prefill per sample; chat prompts are templated with the model's tokenizer (loaded here,
the same class SGLang loads) exactly as in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest, RLInferError
from rlinfer_core.hidden_states import hidden_size
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.merge import merge
from rlinfer_core.preflight import check_kv_room
from rlinfer_core.types import Completion, CompletionDelta, FinishReason, GenerateRequest, LogprobsMode
from rlinfer_sglang import convert, images
from rlinfer_sglang.agent import openai_tools
from rlinfer_sglang.oom import out_of_memory
from rlinfer_sglang.server_mode import convert as wire
from rlinfer_sglang.server_mode.inflight import InFlight


class Generation(InFlight):
    """``rlinfer_generate``, ``rlinfer_generate_stream`` and the raw-generate bench hook."""

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:  # as SGLang will see them (image placeholders expanded)
            return images.expanded_prompt(self.config.model, request, list(request.prompt_token_ids))
        assert request.messages is not None
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise InvalidRequest("messages", "no tokenizer could be loaded for the model; send prompt_token_ids")
        try:
            text = tokenizer.apply_chat_template(
                [m.template_dict() for m in request.messages],
                tools=openai_tools(request.tools),
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as exc:
            raise InvalidRequest("messages", f"the chat template failed: {exc}") from exc
        ids = list(tokenizer.encode(str(text), add_special_tokens=False))
        if not ids:
            raise InvalidRequest("messages", "the chat template produced an empty prompt")
        ids = images.expanded_prompt(self.config.model, request, ids)
        if len(ids) >= self._max_len():
            raise InvalidRequest(
                "messages", f"the templated prompt has {len(ids)} tokens, max_model_len is {self._max_len()}"
            )
        assert self._info is not None
        check_kv_room(len(ids), request.sampling.max_tokens, self._info)
        return ids

    def _out_of_memory(self, exc: Exception) -> Exception:
        """``exc`` as EngineOutOfMemory where SGLang's message says the KV cache could not hold
        the request (:mod:`rlinfer_sglang.oom`), else ``exc``."""
        return out_of_memory(str(exc), self._info) or exc

    def _params(self, request: GenerateRequest, ids: list[int]) -> dict[str, Any]:
        assert self._info is not None
        return convert.sampling_params(request, len(ids), self._max_len(), self._info.vocab_size)

    def _hidden_size(self, request: GenerateRequest) -> int:
        """The served model's hidden size (0 when the request asks for no hidden states)."""
        if not request.sampling.return_hidden_states:
            return 0
        size = hidden_size(self.config.model)
        if size is None:
            raise RLInferError(f"the hidden size of {self.config.model!r} is unknown (no config.json hidden_size)")
        return size

    def _body(self, request: GenerateRequest, ids: list[int], rid: str, stream: bool) -> dict[str, Any]:
        body = wire.sample_body(request, ids, self._params(request, ids), rid, self._processor(), stream)
        inputs = images.engine_input(self.config.model, request, ids)  # input_ids (+ image_data)
        return {**body, **inputs, **convert.priority_arg(request, self._priority_sign)}

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Send every sample in one batched ``/generate``; n completions per request, in order."""
        http = self._alive()
        prompts = [self._prompt_ids(r) for r in requests]
        samples = [(r, i, ids) for r, ids in zip(requests, prompts, strict=True) for i in range(r.sampling.n)]
        started = time.perf_counter()
        admitted = await self._admit_all([r.request_id for r, _, _ in samples])
        rids = [uuid.uuid4().hex if ok else "" for ok in admitted]
        for (r, _, _), rid in zip(samples, rids, strict=True):
            if rid:
                self._track(r.request_id, rid)
        live = [k for k, rid in enumerate(rids) if rid]
        outs: dict[int, Any] = {}
        try:
            # one priority per batched body: a body per priority, concurrently
            batches = [[live[j] for j in group] for group in convert.priority_groups([samples[k][0] for k in live])]
            answers = await asyncio.gather(
                *(
                    http.post(
                        "/generate",
                        wire.batch_body([self._body(samples[k][0], samples[k][2], rids[k], False) for k in batch]),
                    )
                    for batch in batches
                )
            )
            for batch, answer in zip(batches, answers, strict=True):
                results = answer if isinstance(answer, list) else [answer]
                outs.update(zip(batch, results, strict=True))
        except asyncio.CancelledError:
            self._abort_later([rids[k] for k in live])
            raise
        except RLInferError as exc:  # an HTTP 4xx (InvalidRequest) or 5xx (ServerError) answer
            raise self._out_of_memory(exc) from exc
        finally:
            for (r, _, _), rid in zip(samples, rids, strict=True):
                if rid:
                    self._untrack(r.request_id, rid)
                    self._release()
            for r in requests:
                if r.request_id not in self._rids:
                    self._aborted.discard(r.request_id)
        latency = time.perf_counter() - started
        completions = []
        for k, (r, i, ids) in enumerate(samples):
            if k in outs:
                c = convert.completion(r, i, ids, outs[k], latency)
                versions = wire.expand_versions(outs[k].get("meta_info") or {}, len(c.token_ids))
                if versions is None:  # no spans from this SGLang: the loader's record
                    versions = self._versions.of(rids[k], len(c.token_ids))
                prompt_states, states = convert.hidden_states(
                    r, outs[k].get("meta_info") or {}, len(ids), len(c.token_ids), self._hidden_size(r)
                )
                c = attrs.evolve(c, token_versions=versions, hidden_states=states, prompt_hidden_states=prompt_states)
                c = images.with_multimodal(self.config.model, r, c, outs[k].get("meta_info") or {})
            else:
                c = convert.aborted_before_output(r, i, ids, latency)
            completions.append(c)
        for rid in rids:
            self._versions.forget(rid)
        return await convert.with_raw_logprobs(samples, completions, self._raw_logprobs)

    async def _raw_logprobs(
        self, prompt: list[int], tokens: list[int], start: int, top: int
    ) -> tuple[tuple[float, ...], tuple[dict[int, float], ...]]:
        """``log_softmax`` of the raw logits for ``tokens[start:]`` (and their top ``top``), from
        one prefill of ``prompt + tokens`` (SGLang's input-token logprobs are raw)."""
        while not self._gate.is_set():  # paused: score after resume (see rlinfer_pause)
            self._alive()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate.wait(), timeout=0.05)
        self._scoring += 1
        try:
            out = await self._alive().post("/generate", wire.score_body(prompt, tokens, start, top, uuid.uuid4().hex))
        finally:
            self._scoring -= 1
        meta = out.get("meta_info") or {}
        want = len(tokens) - start
        values = [float(e[0]) for e in list(meta.get("input_token_logprobs") or ())[-want:]]
        rows = list(meta.get("input_top_logprobs") or ())[-want:]
        tops = tuple({int(e[1]): float(e[0]) for e in row or ()} for row in rows) if top else ()
        if len(values) != want:
            raise RLInferError(f"SGLang scored {len(values)} of {want} tokens for raw logprobs")
        return tuple(values), tops

    @hookimpl
    async def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream deltas of every sample (SGLang streams cumulative outputs; deltas are cut here)."""
        self._alive()
        ids = self._prompt_ids(request)
        samples = [self._stream_sample(request, i, ids) for i in range(request.sampling.n)]
        try:
            async for delta in merge(samples):
                yield delta
        finally:
            self._aborted.discard(request.request_id)

    async def _stream_sample(
        self, request: GenerateRequest, index: int, ids: list[int]
    ) -> AsyncIterator[CompletionDelta]:
        http = self._alive()
        if not (await self._admit_all([request.request_id]))[0]:
            yield CompletionDelta(request.request_id, index, (), (), FinishReason.ABORT)
            return
        rid = uuid.uuid4().hex
        self._track(request.request_id, rid)
        seen = 0
        finished = False
        try:
            async for out in http.stream("/generate", self._body(request, ids, rid, stream=True)):
                if "error" in out:
                    raise self._out_of_memory(_stream_error(out["error"]))
                before = seen
                d, seen = convert.delta(request, index, out, seen)
                self._received[rid] = seen
                if d is None:
                    continue
                versions = self._versions.of(rid, before + len(d.token_ids), before)
                meta = out.get("meta_info") or {}
                exact = wire.expand_versions(meta, seen) if d.finish_reason is not None else None
                d = attrs.evolve(d, token_versions=exact[before:seen] if exact else versions)
                if request.sampling.logprobs_mode is LogprobsMode.RAW and d.token_ids:
                    so_far = [int(t) for t in out.get("output_ids") or ()][:seen]
                    lps, _ = await self._raw_logprobs(ids, so_far, before, 0)
                    d = attrs.evolve(d, logprobs=lps)
                finished = d.finish_reason is not None
                yield d
                if finished:
                    if not meta.get("finish_reason"):
                        self._abort_later([rid])  # rlinfer ended it (stop id under ignore_eos)
                    break
            if not finished:
                yield CompletionDelta(request.request_id, index, (), (), FinishReason.ABORT)
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self._abort_later([rid])
            raise
        finally:
            self._untrack(request.request_id, rid)
            self._versions.forget(rid)
            self._release()

    # --- benchmarking --------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch in one native batched ``/generate`` call with hand-built params."""
        http = self._alive()
        input_ids: list[list[int]] = []
        params: list[dict[str, Any]] = []
        top: list[int] = []
        for r in requests:
            s = r.sampling
            for _ in range(s.n):
                input_ids.append(list(r.prompt_token_ids or ()))
                p: dict[str, Any] = {
                    "temperature": s.temperature,
                    "top_p": s.top_p,
                    "top_k": s.top_k,
                    "max_new_tokens": s.max_tokens,
                    "min_new_tokens": s.min_tokens,
                    "ignore_eos": s.ignore_eos,
                }
                if s.stop_token_ids:
                    p["stop_token_ids"] = list(s.stop_token_ids)
                if s.stop:
                    p["stop"] = list(s.stop)
                params.append(p)
                top.append(s.logprobs)
        if not input_ids:
            return 0
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "top_logprobs_num": top}
        outs = await http.post("/generate", body)
        return sum(len(o["output_ids"]) for o in (outs if isinstance(outs, list) else [outs]))


def _stream_error(error: Any) -> Exception:
    """An error SGLang reported inside a stream (``data: {"error": ...}``)."""
    message = error.get("message", error) if isinstance(error, dict) else error
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and 400 <= code < 500:
        return InvalidRequest("request", f"the SGLang server refused the stream: {message}")
    return RLInferError(f"the SGLang server failed the stream: {message}")
