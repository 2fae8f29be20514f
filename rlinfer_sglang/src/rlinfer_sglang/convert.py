"""Conversions between rlinfer's request/result types and SGLang's dicts (no SGLang import)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlinfer_core.types import Completion, CompletionDelta, FinishReason, GenerateRequest

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def sampling_params(request: GenerateRequest, prompt_len: int, max_model_len: int) -> dict[str, Any]:
    """SGLang sampling parameters for one sample of ``request``.

    ``max_tokens`` is clipped to the room left in the context, so a long prompt ends with
    finish reason "length" instead of being rejected.
    """
    s = request.sampling
    room = max(max_model_len - prompt_len, 1)
    max_new = min(s.max_tokens, room)
    params: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_new_tokens": max_new,
        "min_new_tokens": min(s.min_tokens, max_new),
        "ignore_eos": s.ignore_eos,
    }
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if s.stop:
        params["stop"] = list(s.stop)
    return params


def stop_cut(request: GenerateRequest, tokens: Sequence[int]) -> int | None:
    """Length to cut ``tokens`` to when they hold a stop token id that SGLang did not act on.

    SGLang's ``ignore_eos=True`` also disables ``stop_token_ids``; for that combination rlinfer
    ends the output itself at the first stop id (included) past ``min_tokens``.
    """
    s = request.sampling
    if not (s.ignore_eos and s.stop_token_ids):
        return None
    stops = set(s.stop_token_ids)
    for i, token in enumerate(tokens):
        if token in stops and i + 1 >= s.min_tokens:
            return i + 1
    return None


def logprob_args(request: GenerateRequest) -> dict[str, Any]:
    """``async_generate`` keyword arguments for the logprobs ``request`` needs."""
    s = request.sampling
    return {
        "return_logprob": True,
        "logprob_start_len": 0 if s.prompt_logprobs else -1,
        "top_logprobs_num": s.logprobs,
    }


def finish(meta: Mapping[str, Any], request: GenerateRequest) -> tuple[FinishReason | None, int | str | None]:
    """(finish reason, stop reason) of an SGLang output's ``meta_info``."""
    info = meta.get("finish_reason")
    if not info:
        return None, None
    reason = _FINISH.get(str(info.get("type")), FinishReason.STOP)
    matched = info.get("matched")
    s = request.sampling
    stop_reason: int | str | None = None
    if reason is FinishReason.STOP and matched is not None:
        is_stop_string = isinstance(matched, str) and matched in s.stop
        is_stop_id = isinstance(matched, int) and matched in s.stop_token_ids
        if is_stop_string or is_stop_id:
            stop_reason = matched
    return reason, stop_reason


def token_logprobs(meta: Mapping[str, Any]) -> list[float]:
    """Per-output-token logprobs (SGLang: (logprob, token id, text) triples)."""
    return [float(entry[0]) for entry in meta.get("output_token_logprobs") or ()]


def _top(rows: Sequence[Any] | None) -> tuple[Mapping[int, float], ...] | None:
    if rows is None:
        return None
    return tuple({int(e[1]): float(e[0]) for e in row or ()} for row in rows)


def completion(
    request: GenerateRequest, index: int, prompt: Sequence[int], out: Mapping[str, Any], latency: float
) -> Completion:
    """A Completion from one SGLang (non-streaming) output dict."""
    meta = out.get("meta_info") or {}
    tokens = tuple(int(t) for t in out.get("output_ids") or ())
    logprobs = tuple(token_logprobs(meta))[: len(tokens)]
    reason, stop_reason = finish(meta, request)
    s = request.sampling
    prompt_lps: tuple[float | None, ...] | None = None
    if s.prompt_logprobs:
        entries = meta.get("input_token_logprobs") or ()
        prompt_lps = tuple(None if e[0] is None else float(e[0]) for e in entries)
        if prompt_lps:
            prompt_lps = (None, *prompt_lps[1:])
    top = _top(meta.get("output_top_logprobs"))[: len(tokens)] if s.logprobs else None  # type: ignore[index]
    cut = stop_cut(request, tokens)
    if cut is not None and (cut < len(tokens) or reason is not FinishReason.ABORT):
        tokens, logprobs, reason, stop_reason = tokens[:cut], logprobs[:cut], FinishReason.STOP, tokens[cut - 1]
        top = top[:cut] if top is not None else None
    return Completion(
        request_id=request.request_id,
        index=index,
        prompt_token_ids=tuple(prompt),
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason=reason or FinishReason.ABORT,
        stop_reason=stop_reason,
        top_logprobs=top,
        prompt_logprobs=prompt_lps,
        text=out.get("text"),
        latency_s=latency,
    )


def aborted_before_output(request: GenerateRequest, index: int, prompt: Sequence[int], latency: float) -> Completion:
    """The completion of a sample aborted before SGLang produced anything for it."""
    return Completion(
        request_id=request.request_id,
        index=index,
        prompt_token_ids=tuple(prompt),
        token_ids=(),
        logprobs=(),
        finish_reason=FinishReason.ABORT,
        prompt_logprobs=() if request.sampling.prompt_logprobs else None,
        top_logprobs=() if request.sampling.logprobs else None,
        latency_s=latency,
    )


def delta(
    request: GenerateRequest, index: int, out: Mapping[str, Any], seen: int
) -> tuple[CompletionDelta | None, int]:
    """The new part of a cumulative streaming output after ``seen`` tokens; (delta, new seen)."""
    meta = out.get("meta_info") or {}
    tokens = [int(t) for t in out.get("output_ids") or ()]
    logprobs = token_logprobs(meta)
    reason, stop_reason = finish(meta, request)
    cut = stop_cut(request, tokens)
    if cut is not None:
        tokens, logprobs, reason, stop_reason = tokens[:cut], logprobs[:cut], FinishReason.STOP, tokens[cut - 1]
    new_tokens = tokens[seen:]
    if not new_tokens and reason is None:
        return None, seen
    return (
        CompletionDelta(
            request_id=request.request_id,
            index=index,
            token_ids=tuple(new_tokens),
            logprobs=tuple(logprobs[seen : len(tokens)]),
            finish_reason=reason,
            stop_reason=stop_reason,
        ),
        len(tokens),
    )
