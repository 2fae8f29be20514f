"""Conversions between rlinfer's request/result types and vLLM's, kept cheap per token.

Requests ask vLLM for *flat* logprobs (``FlatLogprobs``: a few flat lists per sequence instead of
one dict per token), in which each position's first entry is the sampled token and the rest are
its top-k alternatives. vLLM runs with ``logprobs_mode="processed_logprobs"``, so those values
are under the sampling distribution: allowed-token mask and logit bias, penalties, temperature,
min_p, top-k/top-p, renormalised over what survives; greedy requests report the processed
logits at temperature 1, untruncated. Prompt logprobs are always plain log_softmax.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlinfer_core.routing import RoutedExperts, aligned
from rlinfer_core.structured import StructuredKind, StructuredOutput
from rlinfer_core.types import (
    Completion,
    CompletionDelta,
    FinishReason,
    GenerateRequest,
    LogprobsMode,
)

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

FINISH_REASONS: Mapping[str | None, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


def sampling_params(
    request: GenerateRequest, prompt_len: int, max_model_len: int, kind: RequestOutputKind
) -> SamplingParams:
    """vLLM SamplingParams for ``request``; max/min tokens are capped by the context left."""
    from vllm import SamplingParams

    s = request.sampling
    room = max(max_model_len - prompt_len, 1)
    if s.logprobs_mode is LogprobsMode.RAW:
        # raw logprobs are scored over prompt + output afterwards (rlinfer_vllm.raw), and vLLM
        # refuses a prompt that fills the context: keep one position free
        room = max(room - 1, 1)
    return SamplingParams(
        n=engine_n(request),
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0 if s.top_k == -1 else s.top_k,
        seed=s.seed,
        max_tokens=min(s.max_tokens, room),
        min_tokens=min(s.min_tokens, room),
        stop=list(s.stop) or None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_top_logprobs if s.prompt_logprobs else None,
        flat_logprobs=True,
        output_kind=kind,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias={token: float(bias) for token, bias in s.logit_bias} or None,
        allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids is not None else None,
        structured_outputs=structured_outputs(s.structured),
    )


def structured_outputs(constraint: StructuredOutput | None) -> StructuredOutputsParams | None:
    """vLLM's StructuredOutputsParams for a constraint (enforced by vLLM's grammar backend:
    xgrammar, started without free JSON whitespace by :mod:`rlinfer_vllm.backend`)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if constraint.kind is StructuredKind.JSON_SCHEMA:
        return StructuredOutputsParams(json=json.loads(constraint.schema_json))
    if constraint.kind is StructuredKind.REGEX:
        return StructuredOutputsParams(regex=constraint.value)
    if constraint.kind is StructuredKind.EBNF:
        return StructuredOutputsParams(grammar=constraint.value)
    return StructuredOutputsParams(choice=list(constraint.value))


def engine_n(request: GenerateRequest) -> int:
    """Samples vLLM is asked for: vLLM refuses n>1 with greedy sampling, whose n samples are all
    the same, so greedy requests run once and the result is replicated (:func:`replicate`)."""
    return 1 if request.sampling.greedy else request.sampling.n


def replicate(request: GenerateRequest, items: list[Any]) -> list[Any]:
    """Copies of a greedy request's one sample (Completion or CompletionDelta) for indices 1..n-1."""
    n = request.sampling.n
    if n == 1 or not request.sampling.greedy:
        return items
    import attrs

    return [attrs.evolve(item, index=i) for item in items for i in range(n)]


def finish_reason(reason: str | None) -> FinishReason:
    """rlinfer's finish reason for vLLM's string (anything unexpected ends as "abort")."""
    return FINISH_REASONS.get(reason, FinishReason.ABORT)


def _sampled(flat: Any) -> tuple[float, ...]:
    if not flat:
        return ()
    values = flat.logprobs
    return tuple(values[i] for i in flat.start_indices)


def _top(flat: Any) -> tuple[Mapping[int, float], ...]:
    if not flat:
        return ()
    ids, values = flat.token_ids, flat.logprobs
    return tuple(
        dict(zip(ids[a + 1 : b], values[a + 1 : b], strict=True))
        for a, b in zip(flat.start_indices, flat.end_indices, strict=True)
    )


def _prompt(flat: Any) -> tuple[float | None, ...] | None:
    if flat is None:
        return None
    values = flat.logprobs
    return tuple(values[a] if b > a else None for a, b in zip(flat.start_indices, flat.end_indices, strict=True))


def _prompt_top(flat: Any) -> tuple[Mapping[int, float] | None, ...]:
    """Each prompt position's top alternatives (the entries after the token's own; first: None)."""
    ids, values = flat.token_ids, flat.logprobs
    return tuple(
        dict(zip(ids[a + 1 : b], values[a + 1 : b], strict=True)) if b > a else None
        for a, b in zip(flat.start_indices, flat.end_indices, strict=True)
    )


def completions(request: GenerateRequest, out: RequestOutput, latency_s: float) -> list[Completion]:
    """The ``n`` completions of a finished (or aborted) request, by sample index."""
    s = request.sampling
    prompt_ids = tuple(out.prompt_token_ids or ())
    prompt_lps = _prompt(out.prompt_logprobs) if s.prompt_logprobs else None
    prompt_top = _prompt_top(out.prompt_logprobs) if s.prompt_top_logprobs and out.prompt_logprobs else None
    result = []
    for o in sorted(out.outputs, key=lambda o: o.index):
        result.append(
            Completion(
                request_id=request.request_id,
                index=o.index,
                prompt_token_ids=prompt_ids,
                token_ids=tuple(o.token_ids),
                logprobs=_sampled(o.logprobs),
                finish_reason=finish_reason(o.finish_reason),
                stop_reason=o.stop_reason,
                top_logprobs=_top(o.logprobs) if s.logprobs else None,
                prompt_logprobs=prompt_lps,
                prompt_top_logprobs=prompt_top,
                text=o.text,
                latency_s=latency_s,
                routed_experts=_routes(request, o, len(prompt_ids)),
            )
        )
    return result


def _routes(request: GenerateRequest, o: CompletionOutput, prompt_len: int) -> RoutedExperts | None:
    """vLLM's ``routed_experts`` ([prompt + output - 1, layers, top_k], positions from 0) in
    rlinfer's alignment (:mod:`rlinfer_core.routing`); None unless the request asked."""
    rows = getattr(o, "routed_experts", None)
    if not request.sampling.return_routed_experts or rows is None:
        return None
    return aligned(rows, 0, prompt_len + len(o.token_ids), int(rows.shape[1]), int(rows.shape[2]))


def aborted_before_output(request: GenerateRequest, prompt_ids: list[int], latency_s: float) -> list[Completion]:
    """Completions for a request aborted before vLLM produced any output for it."""
    return [
        Completion(
            request_id=request.request_id,
            index=i,
            prompt_token_ids=tuple(prompt_ids),
            token_ids=(),
            logprobs=(),
            finish_reason=FinishReason.ABORT,
            text="",
            latency_s=latency_s,
        )
        for i in range(request.sampling.n)
    ]


def delta(request_id: str, o: CompletionOutput, finished: bool) -> CompletionDelta:
    """One streaming increment from a DELTA-kind output."""
    return CompletionDelta(
        request_id=request_id,
        index=o.index,
        token_ids=tuple(o.token_ids),
        logprobs=_sampled(o.logprobs),
        finish_reason=finish_reason(o.finish_reason) if finished else None,
        stop_reason=o.stop_reason if finished else None,
    )
