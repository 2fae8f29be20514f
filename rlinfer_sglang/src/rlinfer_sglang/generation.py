"""Generate and stream: rlinfer requests to SGLang's tokenizer manager and back."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs

from rlinfer_core.chat_template import prompt_ids
from rlinfer_core.errors import RLInferError
from rlinfer_core.hidden_states import hidden_size
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.merge import merge
from rlinfer_core.preflight import check_kv_room
from rlinfer_core.routing import moe_shape
from rlinfer_core.types import (
    Completion,
    CompletionDelta,
    GenerateRequest,
    LogprobsMode,
)
from rlinfer_sglang import convert, images
from rlinfer_sglang.inflight import InFlight
from rlinfer_sglang.lora import LoraHooks


class Generation(InFlight, LoraHooks):
    """``rlinfer_generate``, ``rlinfer_generate_stream`` and the raw-generate bench hook."""

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        ids = prompt_ids(getattr(self._tm, "tokenizer", None), request, self._max_len())
        ids = images.expanded_prompt(self.config.model, request, ids)  # as SGLang will see them
        if request.prompt_token_ids is None or request.all_images:  # the facade checked plain token ids
            assert self._info is not None
            check_kv_room(len(ids), request.sampling.max_tokens, self._info)
        return ids

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Send every sample to SGLang as one batch; n completions per request, in request order.

        One batched ``GenerateReqInput`` (not one call per sample) lets SGLang's scheduler see
        the whole batch at once, exactly as a native batched ``async_generate`` call does.
        """
        self._alive()
        prompts = [self._prompt_ids(r) for r in requests]
        self._lora_acquire(requests)
        try:
            return await self._generate(requests, prompts)
        finally:
            await self._lora_done(requests)

    async def _generate(self, requests: Sequence[GenerateRequest], prompts: list[list[int]]) -> list[Completion]:
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
            if live:
                results = await self._guard(
                    self._tm_generate_batch([samples[k] for k in live], [rids[k] for k in live])
                )
                outs = dict(zip(live, results, strict=True))
        except asyncio.CancelledError:
            for k in live:
                self._abort_rid(rids[k])
            raise
        except RLInferError:
            raise
        except Exception as exc:
            if not all(r.request_id in self._aborted for r, _, _ in samples):
                raise self._translate(exc) from exc
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
                routes = convert.routed_experts(
                    r, outs[k].get("meta_info") or {}, len(ids) + len(c.token_ids), self._route_shape()
                )
                prompt_states, states = convert.hidden_states(
                    r, outs[k].get("meta_info") or {}, len(ids), len(c.token_ids), self._hidden_size(r)
                )
                c = images.with_multimodal(self.config.model, r, c, outs[k].get("meta_info") or {})
                c = attrs.evolve(
                    c,
                    token_versions=self._versions.of(rids[k], len(c.token_ids)),
                    routed_experts=routes,
                    hidden_states=states,
                    prompt_hidden_states=prompt_states,
                )
            else:
                c = convert.aborted_before_output(r, i, ids, latency)
            completions.append(c)
        for rid in rids:
            self._versions.forget(rid)
        return await convert.with_raw_logprobs(samples, completions, self._raw_logprobs)

    async def _tm_generate_batch(
        self, samples: list[tuple[GenerateRequest, int, list[int]]], rids: list[str]
    ) -> list[Any]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        if len(samples) == 1:
            (request, _, ids), rid = samples[0], rids[0]
            return [await self._tm_generate(ids, self._params(request, ids), rid, request)]
        groups = convert.priority_groups([r for r, _, _ in samples])
        if len(groups) > 1:  # one priority per batched call: a call per priority, concurrently
            parts = await asyncio.gather(
                *(self._tm_generate_batch([samples[k] for k in g], [rids[k] for k in g]) for g in groups)
            )
            out: list[Any] = [None] * len(samples)
            for group, part in zip(groups, parts, strict=True):
                for k, item in zip(group, part, strict=True):
                    out[k] = item
            return out
        args = [convert.logprob_args(r, self._processor()) for r, _, _ in samples]
        inputs = [images.engine_input(self.config.model, r, ids) for r, _, ids in samples]
        if any("image_data" in i for i in inputs):  # a list per sample ([] for none: SGLang's batch form)
            args = [{**a, "image_data": i.get("image_data", [])} for a, i in zip(args, inputs, strict=True)]
        obj = GenerateReqInput(
            input_ids=[i["input_ids"] for i in inputs],
            sampling_params=[self._params(r, ids) for r, _, ids in samples],
            rid=rids,
            # one flag for the whole batch in SGLang; routes are kept only where asked
            return_routed_experts=any(r.sampling.return_routed_experts for r, _, _ in samples),
            return_hidden_states=[r.sampling.return_hidden_states for r, _, _ in samples],
            **{key: [a[key] for a in args] for key in args[0]},
            **convert.priority_arg(samples[0][0], self._priority_sign),
            **self._lora_paths([r for r, _, _ in samples]),
        )
        result: list[Any] = await self._tm.generate_request(obj, None).__anext__()
        return result

    async def _raw_logprobs(
        self, prompt: list[int], tokens: list[int], start: int, top: int
    ) -> tuple[tuple[float, ...], tuple[dict[int, float], ...]]:
        """``log_softmax`` of the raw logits for ``tokens[start:]`` (and their top ``top``).

        SGLang reports output logprobs after its processing, so raw ones come from scoring
        ``prompt + tokens`` in one prefill: its input-token logprobs are ``log_softmax`` of the
        model's raw logits (computed by the weights serving now).
        """

        assert self._gate is not None
        while not self._gate.is_set():  # paused: score after resume (see rlinfer_pause)
            self._alive()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate.wait(), timeout=0.05)
        self._scoring += 1
        try:
            return await self._score(prompt, tokens, start, top)
        finally:
            self._scoring -= 1

    async def _score(
        self, prompt: list[int], tokens: list[int], start: int, top: int
    ) -> tuple[tuple[float, ...], tuple[dict[int, float], ...]]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=prompt + tokens,
            sampling_params={"max_new_tokens": 0, "temperature": 0.0},
            rid=uuid.uuid4().hex,
            return_logprob=True,
            logprob_start_len=len(prompt) + start - 1,  # SGLang leaves the first position out
            top_logprobs_num=top,
        )
        out = await self._guard(self._tm.generate_request(obj, None).__anext__())
        meta = out.get("meta_info") or {}
        want = len(tokens) - start
        values = [float(e[0]) for e in list(meta.get("input_token_logprobs") or ())[-want:]]
        rows = list(meta.get("input_top_logprobs") or ())[-want:]
        tops = tuple({int(e[1]): float(e[0]) for e in row or ()} for row in rows) if top else ()
        if len(values) != want:
            raise RLInferError(f"SGLang scored {len(values)} of {want} tokens for raw logprobs")
        return tuple(values), tops

    def _route_shape(self) -> tuple[int, int] | None:
        """(layers, top_k) of the served MoE model's routes; None for a dense model."""
        return moe_shape(self.config.model)

    def _hidden_size(self, request: GenerateRequest) -> int:
        """The served model's hidden size (0 when the request asks for no hidden states)."""
        if not request.sampling.return_hidden_states:
            return 0
        size = getattr(getattr(self._tm, "model_config", None), "hidden_size", None) or hidden_size(self.config.model)
        if not size:
            raise RLInferError(f"the hidden size of {self.config.model!r} is unknown (no config.json hidden_size)")
        return int(size)

    def _lora_paths(self, requests: Sequence[GenerateRequest]) -> dict[str, Any]:
        """``GenerateReqInput``'s per-sample ``lora_path`` list ({} when no sample names an adapter)."""
        paths = [self._lora_arg(r).get("lora_path") for r in requests]
        return {"lora_path": paths} if any(paths) else {}

    def _params(self, request: GenerateRequest, ids: list[int]) -> dict[str, Any]:
        assert self._info is not None
        return convert.sampling_params(request, len(ids), self._max_len(), self._info.vocab_size)

    def _processor(self) -> str:
        """SGLang's serialized form of rlinfer's logits processor (built once)."""
        if not self._processor_str:
            from rlinfer_sglang.logits import serialized

            self._processor_str = serialized()
        return self._processor_str

    def _tm_generate(
        self, ids: list[int], params: dict[str, Any], rid: str, request: GenerateRequest, stream: bool = False
    ) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            **images.engine_input(self.config.model, request, ids),
            sampling_params=params,
            rid=rid,
            stream=stream,
            return_routed_experts=request.sampling.return_routed_experts,
            return_hidden_states=request.sampling.return_hidden_states,
            **convert.logprob_args(request, self._processor()),
            **convert.priority_arg(request, self._priority_sign),
            **self._lora_arg(request),
        )
        generator = self._tm.generate_request(obj, None)
        return generator if stream else generator.__anext__()

    @hookimpl
    async def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream deltas of every sample (SGLang streams cumulative outputs; deltas are cut here)."""
        self._alive()
        ids = self._prompt_ids(request)
        self._lora_acquire([request])
        samples = [self._stream_sample(request, i, ids) for i in range(request.sampling.n)]
        try:
            async for delta in merge(samples):
                yield delta
        finally:
            self._aborted.discard(request.request_id)
            await self._lora_done([request])

    async def _stream_sample(
        self, request: GenerateRequest, index: int, ids: list[int]
    ) -> AsyncIterator[CompletionDelta]:
        from rlinfer_core.types import FinishReason

        if not await self._admit(request.request_id):
            yield CompletionDelta(request.request_id, index, (), (), FinishReason.ABORT)
            return
        rid = uuid.uuid4().hex
        self._track(request.request_id, rid)
        params = self._params(request, ids)
        seen = 0
        finished = False
        try:
            generator = self._tm_generate(ids, params, rid, request, stream=True)
            while not finished:
                try:
                    out = await self._guard(generator.__anext__())
                except StopAsyncIteration:
                    break
                before = seen
                d, seen = convert.delta(request, index, out, seen)
                if d is not None:
                    versions = self._versions.of(rid, before + len(d.token_ids), before)
                    d = attrs.evolve(d, token_versions=versions)
                    if request.sampling.logprobs_mode is LogprobsMode.RAW and d.token_ids:
                        so_far = [int(t) for t in out.get("output_ids") or ()][: before + len(d.token_ids)]
                        lps, _ = await self._raw_logprobs(ids, so_far, before, 0)
                        d = attrs.evolve(d, logprobs=lps)
                    finished = d.finish_reason is not None
                    if finished and not (out.get("meta_info") or {}).get("finish_reason"):
                        self._abort_rid(rid)  # rlinfer ended it (stop id under ignore_eos)
                    yield d
            if not finished:
                yield CompletionDelta(request.request_id, index, (), (), FinishReason.ABORT)
        except (asyncio.CancelledError, GeneratorExit):
            self._abort_rid(rid)
            raise
        except RLInferError:
            raise
        except Exception as exc:
            raise self._translate(exc) from exc
        finally:
            self._untrack(request.request_id, rid)
            self._versions.forget(rid)
            self._release()

    # --- benchmarking --------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch in one native ``Engine.async_generate`` call with hand-built params."""
        self._alive()
        assert self._engine is not None
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
        self._cache_dirty = True  # the baseline skips the admission gate, but fills the radix cache
        outs = await self._guard(
            self._engine.async_generate(
                input_ids=input_ids, sampling_params=params, return_logprob=True, top_logprobs_num=top
            )
        )
        return sum(len(o["output_ids"]) for o in outs)
