"""SGLang's output dicts (``text``, ``output_ids``, ``meta_info``; the same in process and from
``/generate``) as rlinfer's completions and stream deltas; no SGLang import.

Weight versions: SGLang's scheduler (0.5.2x) keeps, per request, the output length at every
weight-version label change and reports a finished request's tokens as spans per label
(``meta_info["weight_versions"]``); the HTTP transport sets the label to rlinfer's version number
while nothing runs, so :func:`expand_versions` gives each token the version that computed it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.hidden_states import HiddenStates, split_positions
from rlinfer_core.routing import RoutedExperts, aligned
from rlinfer_core.types import Completion, CompletionDelta, FinishReason, GenerateRequest, LogprobsMode
from rlinfer_sglang.requests import point_mass, renormalises

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def stop_text(request: GenerateRequest, text: str | None, stop_reason: int | str | None) -> str | None:
    """``text`` cut at the stop_regex match that ended it (kept with include_stop_str_in_output):
    SGLang trims stop strings itself but leaves a regex match (and what the last token adds after
    it) in the text."""
    s = request.sampling
    if text is None or not isinstance(stop_reason, str) or stop_reason not in s.stop_regex:
        return text
    match = re.search(stop_reason, text)
    if match is None:
        return text
    return text[: match.end()] if s.include_stop_str_in_output else text[: match.start()]


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


def renormalise(meta: Mapping[str, Any], logprobs: list[float], top: list[dict[int, float]] | None) -> None:
    """Turn SGLang's temperature-scaled logprobs into logprobs of the truncated distribution.

    SGLang's selected-mode sampling mask gives, per token, the support it sampled from and
    ``log(p / mass)`` of the sampled token; every top entry shifts by the same ``-log(mass)``
    and entries outside the support are dropped. In place.
    """
    masks = meta.get("output_token_sampling_mask") or ()
    selected = meta.get("output_token_sampling_logprobs") or ()
    for i, (support, value) in enumerate(zip(masks, selected, strict=False)):
        if i >= len(logprobs):
            break
        shift = float(value) - logprobs[i]
        logprobs[i] = float(value)
        if top is not None and i < len(top):
            keep = set(support)
            top[i] = {t: lp + shift for t, lp in top[i].items() if t in keep}


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
        is_stop_string = isinstance(matched, str) and (matched in s.stop or matched in s.stop_regex)
        is_stop_id = isinstance(matched, int) and matched in s.stop_token_ids
        if is_stop_string or is_stop_id:
            stop_reason = matched
    return reason, stop_reason


def token_logprobs(meta: Mapping[str, Any]) -> list[float]:
    """Per-output-token logprobs (SGLang: (logprob, token id, text) triples)."""
    return [float(entry[0]) for entry in meta.get("output_token_logprobs") or ()]


def _top(rows: Sequence[Any] | None, k: int) -> tuple[Mapping[int, float], ...] | None:
    """The ``k`` most likely entries of each position's (logprob, token id, text) triples."""
    if rows is None:
        return None
    return tuple(_best(row, k) for row in rows)


def _best(row: Sequence[Any] | None, k: int) -> dict[int, float]:
    ranked = sorted(((float(e[0]), int(e[1])) for e in row or () if e[0] is not None), reverse=True)
    return {token: lp for lp, token in ranked[:k]}


def _prompt_top(meta: Mapping[str, Any], k: int) -> tuple[Mapping[int, float] | None, ...]:
    """Each prompt position's ``k`` most likely tokens; the first position has none."""
    rows = list(meta.get("input_top_logprobs") or ())
    return tuple(None if i == 0 else _best(row, k) for i, row in enumerate(rows))


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
    top = _top(meta.get("output_top_logprobs"), s.logprobs)[: len(tokens)] if s.logprobs else None  # type: ignore[index]
    prompt_top = _prompt_top(meta, s.prompt_top_logprobs) if s.prompt_top_logprobs else None
    if renormalises(request):
        lps, tops = list(logprobs), None if top is None else [dict(t) for t in top]
        renormalise(meta, lps, tops)
        logprobs, top = tuple(lps), None if tops is None else tuple(tops)
    elif point_mass(request):
        logprobs = (0.0,) * len(logprobs)
        top = None if top is None else tuple({t: 0.0} for t in tokens[: len(top)])
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
        prompt_top_logprobs=prompt_top,
        text=stop_text(request, out.get("text"), stop_reason),
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
    if renormalises(request):
        renormalise(meta, logprobs, None)
    elif point_mass(request):
        logprobs = [0.0] * len(logprobs)
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


#: scores ``(prompt ids, completion ids, first scored index, top-k)`` -> (raw logprobs, top logprobs)
RawScores = tuple[tuple[float, ...], tuple[dict[int, float], ...]]
RawScorer = Callable[[list[int], list[int], int, int], Awaitable[RawScores]]


async def with_raw_logprobs(
    samples: Sequence[tuple[GenerateRequest, int, list[int]]], completions: list[Completion], score: RawScorer
) -> list[Completion]:
    """Replace the logprobs of raw-mode completions by ``score``'s raw ones (all at once); shared
    by the in-process and the server-mode backend."""
    raw = [
        k
        for k, ((r, _, _), c) in enumerate(zip(samples, completions, strict=True))
        if r.sampling.logprobs_mode is LogprobsMode.RAW and c.token_ids
    ]
    if not raw:
        return completions
    scored = await asyncio.gather(
        *(score(samples[k][2], list(completions[k].token_ids), 0, samples[k][0].sampling.logprobs) for k in raw)
    )
    out = list(completions)
    for k, (lps, top) in zip(raw, scored, strict=True):
        tops = top if samples[k][0].sampling.logprobs else out[k].top_logprobs
        out[k] = attrs.evolve(out[k], logprobs=lps, top_logprobs=tops)
    return out


def routed_experts(
    request: GenerateRequest, meta: Mapping[str, Any], num_tokens: int, shape: tuple[int, int] | None
) -> RoutedExperts | None:
    """The routes of one output in rlinfer's alignment (:mod:`rlinfer_core.routing`): SGLang's
    ``meta_info.routed_experts`` is base64 int32, rows for positions ``[0, prompt + output - 1)``."""
    encoded = meta.get("routed_experts")
    if not request.sampling.return_routed_experts or shape is None:
        return None
    import base64

    import numpy as np

    rows = np.frombuffer(base64.b64decode(encoded), dtype=np.int32) if encoded else np.zeros(0, np.int32)
    return aligned(rows, 0, num_tokens, *shape)


def hidden_states(
    request: GenerateRequest, meta: Mapping[str, Any], prompt_len: int, output_len: int, hidden_size: int
) -> tuple[HiddenStates | None, HiddenStates | None]:
    """``(prompt_hidden_states, hidden_states)`` of one output in rlinfer's alignment
    (:mod:`rlinfer_core.hidden_states`), both None unless the request asked. SGLang's
    ``meta_info.hidden_states`` holds one ``[positions, hidden]`` list per prefill chunk it computed
    (the last one ends at the prompt's last position; cached positions have none), then one row per
    decode step (the state at each fed-back generated token)."""
    if not request.sampling.return_hidden_states:
        return None, None
    import numpy as np

    prefill: list[Any] = []
    decode: list[Any] = []
    for entry in meta.get("hidden_states") or ():
        rows = np.asarray(entry, dtype=np.float32)
        (prefill if rows.ndim == 2 else decode).append(rows.reshape(-1, hidden_size))
    computed = prefill + decode
    rows = np.concatenate(computed) if computed else np.empty((0, hidden_size), np.float32)
    start = prompt_len - sum(len(p) for p in prefill)
    return split_positions(
        rows, start, prompt_len, output_len, hidden_size, with_prompt=request.sampling.prompt_hidden_states
    )


def expand_versions(meta: Mapping[str, Any], count: int) -> tuple[int, ...] | None:
    """Per-token versions from SGLang's ``weight_versions`` spans; None when the answer has none
    (an older SGLang, or no label was set) or a span carries a label rlinfer did not set."""
    spans = meta.get("weight_versions")
    if not spans:
        return None
    out: list[int | None] = [None] * count
    for span in spans:
        try:
            version = int(str(span["version"]))
        except (TypeError, ValueError, KeyError):
            return None
        for i in range(max(int(span["start"]), 0), min(int(span["end"]), count)):
            out[i] = version
    if any(v is None for v in out):
        return None
    return tuple(v for v in out if v is not None)
