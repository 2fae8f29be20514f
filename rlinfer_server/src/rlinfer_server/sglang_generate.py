"""SGLang's ``/generate`` over an rlinfer engine: its body -> GenerateRequests, Completions -> its
answer (``text``, ``output_ids``, ``meta_info`` with ``finish_reason``, token counts,
``output_token_logprobs`` ``[[logprob, token_id, text|None]...]``, ``weight_version`` and
``weight_versions`` spans; ``routed_experts`` when ``return_routed_experts``: base64 of int32
``[positions, layers, top_k]`` for positions ``[routed_experts_start_len, prompt + output - 1)``,
as SGLang's detokenizer encodes it; :func:`rlinfer_core.routing.engine_rows`); ``hidden_states``
when ``return_hidden_states``: SGLang's layout of an uncached prefill, ``[prompt rows]`` then one
row per decode step (:func:`hidden_states_of`).

Batches behave as SGLang's: a list of prompts (or ``n`` > 1) answers a list, prompt-major (the
``n`` samples of prompt *i* are contiguous); one prompt with ``n`` = 1 answers one object.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import attrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import Completion, FinishReason, GenerateRequest, SamplingParams
from rlinfer_server.convert import Tokens, stop_strings, token_bias
from rlinfer_server.sglang_schemas import SglGenerateBody, SglSamplingParams

T = TypeVar("T")

#: rlinfer SamplingParams field -> the SGLang name a client sent (for error messages)
SGLANG_FIELD = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed"}


@attrs.frozen
class PromptPlan:
    """What one prompt of a ``/generate`` body asks besides sampling: logprobs and text options."""

    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    text_in_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    stop: tuple[str, ...]
    #: first position of ``meta_info.routed_experts`` (None: routes not asked)
    routes_from: int | None = None
    #: answer ``meta_info.hidden_states``
    hidden_states: bool = False


@attrs.frozen
class GeneratePlan:
    """The requests of a body, each with its plan, and whether the answer is a list."""

    requests: tuple[GenerateRequest, ...]
    plans: tuple[PromptPlan, ...]
    batched: bool


def _item(value: T | list[T] | None, index: int, count: int, field: str, default: T) -> T:
    """The ``index``-th prompt's value of a per-prompt field (a scalar applies to every prompt)."""
    if value is None:
        return default
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequest(field, f"has {len(value)} entries for {count} prompts")
        chosen = value[index]
        return default if chosen is None else chosen
    return value


def _prompts(body: SglGenerateBody, tokens: Tokens) -> tuple[list[list[int]], bool]:
    """Token ids of every prompt, and whether the body was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequest("input_ids", "give exactly one of text and input_ids")
    if body.input_ids is not None:
        ids = body.input_ids
        if not ids:
            raise InvalidRequest("input_ids", "must not be empty")
        if isinstance(ids[0], list):
            return [list(p) for p in ids if isinstance(p, list)], True
        return [[int(t) for t in ids if isinstance(t, int)]], False
    assert body.text is not None
    if isinstance(body.text, list):
        return [tokens.encode(t) for t in body.text], True
    return [tokens.encode(body.text)], False


def _image_data(body: SglGenerateBody, index: int, count: int, batched: bool) -> list[str]:
    """The ``index``-th prompt's images (data: URLs) of SGLang's ``image_data`` forms."""
    data = body.image_data
    if data is None:
        return []
    if not batched:
        return [data] if isinstance(data, str) else [d for d in data if isinstance(d, str)]
    if not isinstance(data, list) or len(data) != count:
        raise InvalidRequest("image_data", f"a batch of {count} prompts needs a list of {count} image lists")
    item = data[index]
    if item is None:
        return []
    return [item] if isinstance(item, str) else list(item)


def rlinfer_priority(priority: int | None) -> int:
    """rlinfer's priority (lower first) of an SGLang one (higher first, SGLang's default order)."""
    if priority is None:
        return 0
    if isinstance(priority, bool) or not -(2**31) < priority < 2**31:
        raise InvalidRequest("priority", f"must be an integer in ({-(2**31)}, {2**31}), got {priority!r}")
    return -priority


def sampling_of(params: SglSamplingParams, logprobs: int, prompt_logprobs: bool) -> SamplingParams:
    """rlinfer SamplingParams of SGLang ``sampling_params`` (errors name SGLang's fields);
    ``logprobs`` alternatives per position, for the prompt's positions too when ``prompt_logprobs``
    (SGLang's one ``top_logprobs_num``)."""
    from rlinfer_core.structured import StructuredOutput

    constraints = [c for c in (params.json_schema, params.regex, params.choice, params.ebnf) if c is not None]
    if len(constraints) > 1:
        raise InvalidRequest("sampling_params.json_schema", "give at most one of json_schema, regex, choice and ebnf")
    structured: StructuredOutput | None = None
    if params.json_schema is not None:
        structured = StructuredOutput.json(params.json_schema)
    elif params.regex is not None:
        structured = StructuredOutput.regex(params.regex)
    elif params.choice is not None:
        structured = StructuredOutput.choices(params.choice)
    elif params.ebnf is not None:
        structured = StructuredOutput.ebnf(params.ebnf)
    bias = token_bias(params.logit_bias, "sampling_params.logit_bias")
    if params.max_new_tokens is None:
        raise InvalidRequest("sampling_params.max_new_tokens", "must be given (rlinfer bounds every request)")
    stop = stop_strings(params.stop)
    try:
        return SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            n=params.n,
            seed=params.sampling_seed,
            stop_token_ids=tuple(params.stop_token_ids or ()),
            stop=tuple(stop),
            stop_regex=tuple(stop_strings(params.stop_regex)),
            include_stop_str_in_output=params.no_stop_trim,
            ignore_eos=params.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=logprobs if prompt_logprobs else 0,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=tuple(bias),
            structured=structured,
        )
    except InvalidRequest as exc:
        field = exc.field.removeprefix("sampling.")
        reason = str(exc).removeprefix(f"invalid {exc.field}: ")
        raise InvalidRequest(f"sampling_params.{SGLANG_FIELD.get(field, field)}", reason) from None


def generate_plan(body: SglGenerateBody, tokens: Tokens) -> GeneratePlan:
    """Every GenerateRequest of a ``/generate`` body (checked; nothing reaches the engine yet)."""
    prompts, batched = _prompts(body, tokens)
    count = len(prompts)
    rids = body.rid if isinstance(body.rid, list) else None
    if rids is not None and len(rids) != count:
        raise InvalidRequest("rid", f"has {len(rids)} entries for {count} prompts")
    requests: list[GenerateRequest] = []
    plans: list[PromptPlan] = []
    for i, prompt in enumerate(prompts):
        params = _item(body.sampling_params, i, count, "sampling_params", SglSamplingParams())
        return_logprob = bool(_item(body.return_logprob, i, count, "return_logprob", False))
        start = int(_item(body.logprob_start_len, i, count, "logprob_start_len", -1))
        top = int(_item(body.top_logprobs_num, i, count, "top_logprobs_num", 0))
        if start >= len(prompt):
            raise InvalidRequest("logprob_start_len", f"must be < the prompt's {len(prompt)} tokens, got {start}")
        prompt_logprobs = return_logprob and start >= 0
        if prompt_logprobs and body.stream:
            raise InvalidRequest("logprob_start_len", "prompt logprobs are not available when streaming")
        sampling = sampling_of(params, top if return_logprob else 0, prompt_logprobs)
        rid = rids[i] if rids is not None else (body.rid if isinstance(body.rid, str) and count == 1 else None)
        requests.append(
            GenerateRequest(
                prompt_token_ids=prompt,
                sampling=sampling,
                request_id=rid or uuid.uuid4().hex,
                lora=body.lora_path,
                priority=rlinfer_priority(body.priority),
                images=_image_data(body, i, count, batched),
            )
        )
        plans.append(
            PromptPlan(
                return_logprob=return_logprob,
                logprob_start_len=start,
                top_logprobs_num=top,
                text_in_logprobs=body.return_text_in_logprobs,
                skip_special_tokens=params.skip_special_tokens,
                no_stop_trim=params.no_stop_trim,
                stop=sampling.stop,
            )
        )
    if body.return_routed_experts:
        requests, plans = _with_routes(body, requests, plans)
    if body.return_hidden_states:
        if body.stream:
            raise InvalidRequest("return_hidden_states", "hidden states come with batch answers, not when streaming")
        requests = [attrs.evolve(r, sampling=_with_hidden_states(r.sampling)) for r in requests]
        plans = [attrs.evolve(p, hidden_states=True) for p in plans]
    many = batched or any(r.sampling.n > 1 for r in requests)
    if body.stream and many:
        raise InvalidRequest("stream", "streaming takes one prompt with n = 1 here")
    return GeneratePlan(tuple(requests), tuple(plans), many)


def _with_routes(
    body: SglGenerateBody, requests: list[GenerateRequest], plans: list[PromptPlan]
) -> tuple[list[GenerateRequest], list[PromptPlan]]:
    """Ask every request for its routes (SGLang's ``return_routed_experts``); the start position
    must lie in ``[0, prompt tokens]`` as SGLang checks it."""
    if body.stream:
        raise InvalidRequest("return_routed_experts", "routes come with batch answers, not when streaming")
    start = body.routed_experts_start_len
    for r in requests:
        prompt = len(r.prompt_token_ids or ())
        if not 0 <= start <= prompt:
            raise InvalidRequest("routed_experts_start_len", f"must be in [0, {prompt}] (the prompt), got {start}")
    asked = [attrs.evolve(r, sampling=attrs.evolve(r.sampling, return_routed_experts=True)) for r in requests]
    return asked, [attrs.evolve(p, routes_from=start) for p in plans]


def _with_hidden_states(sampling: SamplingParams) -> SamplingParams:
    return attrs.evolve(sampling, return_hidden_states=True, prompt_hidden_states=True)


def hidden_states_of(c: Completion) -> list[Any] | None:
    """SGLang's ``meta_info.hidden_states`` of an uncached request: the prefill's rows (every
    prompt position, one list), then one row per decode step (the states at the generated tokens
    fed back: rlinfer's output rows but the first, which is the prompt's last)."""
    if c.hidden_states is None or c.prompt_hidden_states is None:
        return None
    return [c.prompt_hidden_states.tolist(), *c.hidden_states.tolist()[1:]]


def routes_base64(c: Completion, start: int) -> str | None:
    """SGLang's ``meta_info.routed_experts``: base64 of the int32 rows ``[start, tokens - 1)``."""
    if c.routed_experts is None:
        return None
    import base64

    from rlinfer_core.routing import engine_rows

    return base64.b64encode(engine_rows(c.routed_experts, start).tobytes()).decode("ascii")


def finish_reason(c: Completion) -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` object: ``{type: "length", length}``, ``{type: "stop", matched}``
    (the stop token id or string; EOS: its id) or ``{type: "abort", message}``."""
    if c.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason is FinishReason.STOP:
        matched = c.stop_reason if c.stop_reason is not None else (c.token_ids[-1] if c.token_ids else None)
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": "aborted"}


def version_spans(versions: Sequence[int]) -> list[dict[str, Any]]:
    """``weight_versions`` spans ``[{version, start, end}]`` (half-open over output tokens)."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def _entry(tokens: Tokens, logprob: float | None, token_id: int, with_text: bool) -> list[Any]:
    return [logprob, token_id, tokens.piece(token_id) if with_text else None]


def _ranked(tokens: Tokens, top: Mapping[int, float], with_text: bool) -> list[list[Any]]:
    """One position's alternatives as SGLang's triples, most likely first."""
    return [_entry(tokens, lp, t, with_text) for t, lp in sorted(top.items(), key=lambda kv: -kv[1])]


def _text(c: Completion, plan: PromptPlan, tokens: Tokens) -> str:
    text = tokens.decode(c.token_ids, plan.skip_special_tokens)
    if not plan.no_stop_trim and isinstance(c.stop_reason, str) and text.endswith(c.stop_reason):
        text = text[: -len(c.stop_reason)]  # SGLang trims a matched stop string unless no_stop_trim
    return text


def answer_of(c: Completion, plan: PromptPlan, tokens: Tokens, sample_id: str) -> dict[str, Any]:
    """SGLang's answer for one completion."""
    versions = c.token_versions or (c.weight_version,) * len(c.token_ids)
    meta: dict[str, Any] = {
        "id": sample_id,
        "finish_reason": finish_reason(c),
        "prompt_tokens": len(c.prompt_token_ids),
        "completion_tokens": len(c.token_ids),
        "cached_tokens": 0,
        "weight_version": str(c.weight_version),
        "weight_versions": version_spans(versions),
        "token_weight_versions": list(versions),
    }
    if plan.return_logprob:
        with_text = plan.text_in_logprobs
        meta["output_token_logprobs"] = [
            _entry(tokens, lp, t, with_text) for lp, t in zip(c.logprobs, c.token_ids, strict=True)
        ]
        prompt: list[list[Any]] = []
        if plan.logprob_start_len >= 0 and c.prompt_logprobs is not None:
            pairs = list(zip(c.prompt_logprobs, c.prompt_token_ids, strict=True))[plan.logprob_start_len :]
            prompt = [_entry(tokens, lp, t, with_text) for lp, t in pairs]
        meta["input_token_logprobs"] = prompt
        if plan.top_logprobs_num > 0 and plan.logprob_start_len >= 0 and c.prompt_top_logprobs is not None:
            meta["input_top_logprobs"] = [
                None if top is None else _ranked(tokens, top, with_text)
                for top in c.prompt_top_logprobs[plan.logprob_start_len :]
            ]
        if plan.top_logprobs_num > 0 and c.top_logprobs is not None:
            meta["output_top_logprobs"] = [_ranked(tokens, top, with_text) for top in c.top_logprobs]
    routes = None if plan.routes_from is None else routes_base64(c, plan.routes_from)
    if routes is not None:  # SGLang leaves the key out of an answer without routes
        meta["routed_experts"] = routes
    states = hidden_states_of(c) if plan.hidden_states else None
    if states is not None:
        meta["hidden_states"] = states
    return {"text": _text(c, plan, tokens), "output_ids": list(c.token_ids), "meta_info": meta}


def answers_of(plan: GeneratePlan, completions: Sequence[Completion], tokens: Tokens) -> Any:
    """The whole ``/generate`` answer: one object, or a list in prompt-major order."""
    by_request: dict[str, list[Completion]] = {}
    for c in completions:
        by_request.setdefault(c.request_id, []).append(c)
    out: list[dict[str, Any]] = []
    for request, prompt_plan in zip(plan.requests, plan.plans, strict=True):
        samples = sorted(by_request.get(request.request_id, []), key=lambda c: c.index)
        for c in samples:
            sample_id = request.request_id if request.sampling.n == 1 else f"{request.request_id}-{c.index}"
            out.append(answer_of(c, prompt_plan, tokens, sample_id))
    return out if plan.batched else out[0]
