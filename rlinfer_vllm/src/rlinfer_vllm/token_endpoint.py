"""rlinfer requests to vLLM's token-in/token-out ``/inference/v1/generate`` bodies, and its answers
back to :class:`Completion` / :class:`CompletionDelta`.

The sampling fields are vLLM's own ``SamplingParams`` (the server parses them into it), mapped as
in-process (:func:`rlinfer_vllm.engine_io.sampling_params`). Logprobs come back per position as the
sampled token's entry plus a ``top_logprobs`` list cut to the first ``k`` entries of a dict that
starts with the sampled token; so the server is asked for ``k + 1`` alternatives and the top ``k``
are picked by rank (which always leaves exactly the engine's top ``k``).

Weight versions: the engine core labels every step's outputs with its weight-version label
(``/update_weight_version``), and a finished choice carries the spans of its tokens per label
(``weight_versions``); the backend sets the label to rlinfer's version number while the scheduler
is paused, so :func:`expand_versions` gives each token the version that computed it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rlinfer_core.errors import InvalidRequest, UnsupportedCapability
from rlinfer_core.types import (
    Capability,
    Completion,
    CompletionDelta,
    GenerateRequest,
    LogprobsMode,
)
from rlinfer_vllm.engine_io import engine_n, finish_reason

#: vLLM clamps -inf logprobs to this in its HTTP answers
CLAMPED = -9999.0

#: vLLM's prefix for requests of /inference/v1/generate (its abort endpoint takes these ids)
ID_PREFIX = "generate-tokens-"


def engine_request_id(request_id: str) -> str:
    """The id vLLM's engine knows a /inference/v1/generate request by."""
    return f"{ID_PREFIX}{request_id}"


def sampling(request: GenerateRequest, prompt_len: int, max_model_len: int) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields for ``request`` (JSON); max/min tokens capped by the context left."""
    s = request.sampling
    if s.logprobs_mode is not LogprobsMode.PROCESSED:
        raise UnsupportedCapability(
            Capability.LOGPROBS_RAW.value, "vllm", "vLLM's logprobs_mode is one per engine; rlinfer runs it processed"
        )
    room = max(max_model_len - prompt_len, 1)
    params: dict[str, Any] = {
        "n": engine_n(request),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": 0 if s.top_k == -1 else s.top_k,
        "seed": s.seed,
        "max_tokens": min(s.max_tokens, room),
        "min_tokens": min(s.min_tokens, room),
        "ignore_eos": s.ignore_eos,
        "logprobs": s.logprobs + 1 if s.logprobs else 0,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
    }
    if s.stop:
        params["stop"] = list(s.stop)
        params["include_stop_str_in_output"] = s.include_stop_str_in_output
    else:
        # ids only: the server's output processor then skips its per-token detokenization (and
        # the decoding of every logprob's token), which costs more than the rest of the answer
        params["detokenize"] = False
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if s.prompt_logprobs:
        params["prompt_logprobs"] = s.prompt_top_logprobs
    if s.logit_bias:
        params["logit_bias"] = {str(token): float(bias) for token, bias in s.logit_bias}
    if s.allowed_token_ids is not None:
        params["allowed_token_ids"] = list(s.allowed_token_ids)
    return params


def body(
    request: GenerateRequest, prompt_ids: Sequence[int], max_model_len: int, stream: bool, salt: str | None
) -> dict[str, Any]:
    """The JSON body of ``/inference/v1/generate`` for ``request`` (``salt``: its ``cache_salt``,
    :mod:`rlinfer_vllm.versions`)."""
    payload = {
        "request_id": request.request_id,
        "token_ids": list(prompt_ids),
        "sampling_params": sampling(request, len(prompt_ids), max_model_len),
        "stream": stream,
        "output_mode": "tokens",
        "priority": request.priority,
    }
    if salt is not None:
        payload["cache_salt"] = salt
    return payload


def _lp(value: float) -> float:
    return -math.inf if value <= CLAMPED else float(value)


def compact_logprobs(choice: Mapping[str, Any], with_top: bool) -> dict[str, Any]:
    """A token-endpoint choice's logprobs in the batch route's compact shape: ``"lp"``, the
    sampled tokens' logprobs, and (``with_top``: top-k asked for) ``"top"``, each token's
    ``[token_id, logprob, rank]`` triples, in place of ``logprobs.content``, a dict per token.
    Empty when the choice has no logprobs."""
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        return {}
    shape: dict[str, Any] = {"lp": [c["logprob"] for c in content]}
    if with_top:
        shape["top"] = [
            [[t["token_id"], t["logprob"], t.get("rank")] for t in c.get("top_logprobs") or ()] for c in content
        ]
    return shape


def _logprobs(choice: Mapping[str, Any], k: int) -> tuple[tuple[float, ...], tuple[Mapping[int, float], ...] | None]:
    """(sampled logprobs, top-k by rank or None) of a choice in either shape: the batch route's
    compact one, or the token endpoint's own (per-request path, streams)."""
    if "lp" not in choice:
        choice = compact_logprobs(choice, with_top=bool(k))
    sampled = tuple(_lp(v) for v in choice.get("lp") or ())
    if not k:
        return sampled, None
    tops = []
    for row in choice.get("top") or ():
        ranked = sorted(row, key=lambda t: t[2] or math.inf)
        tops.append({int(t[0]): _lp(t[1]) for t in ranked if (t[2] or math.inf) <= k})
    return sampled, tuple(tops)


def prompt_logprobs(answer: Mapping[str, Any], prompt_ids: Sequence[int]) -> tuple[float | None, ...] | None:
    """Each prompt token's logprob (the first is None) from the answer's ``prompt_logprobs``."""
    rows = answer.get("prompt_logprobs")
    if rows is None:
        return None
    out: list[float | None] = []
    for token, row in zip(prompt_ids, rows, strict=False):
        entry = None if row is None else row.get(str(token))
        out.append(None if entry is None else _lp(entry["logprob"]))
    return tuple(out)


def prompt_top_logprobs(answer: Mapping[str, Any], k: int) -> tuple[Mapping[int, float] | None, ...] | None:
    """Each prompt position's ``k`` most likely tokens (rank <= k; the first position: None)."""
    rows = answer.get("prompt_logprobs")
    if rows is None:
        return None
    return tuple(
        None if row is None else {int(t): _lp(e["logprob"]) for t, e in row.items() if (e.get("rank") or math.inf) <= k}
        for row in rows
    )


def expand_versions(spans: Sequence[Mapping[str, Any]] | None, count: int, fallback: int) -> tuple[int, ...]:
    """Per-token versions from vLLM's ``weight_versions`` spans; ``fallback`` where none is known."""
    out = [fallback] * count
    for span in spans or ():
        try:
            version = int(span["version"])
        except (TypeError, ValueError):  # a label rlinfer did not set (attached server)
            continue
        for i in range(max(int(span["start"]), 0), min(int(span["end"]), count)):
            out[i] = version
    return tuple(out)


def completions(
    request: GenerateRequest,
    prompt_ids: Sequence[int],
    answer: Mapping[str, Any],
    latency_s: float,
    live_version: int,
) -> list[Completion]:
    """The completions of a finished (or aborted) request, by sample index, with token versions."""
    s = request.sampling
    prompt = tuple(prompt_ids)
    prompt_lps = prompt_logprobs(answer, prompt) if s.prompt_logprobs else None
    prompt_top = prompt_top_logprobs(answer, s.prompt_top_logprobs) if s.prompt_top_logprobs else None
    result = []
    for choice in sorted(answer.get("choices") or (), key=lambda c: c["index"]):
        tokens = tuple(choice.get("token_ids") or ())
        sampled, top = _logprobs(choice, s.logprobs)
        result.append(
            Completion(
                request_id=request.request_id,
                index=int(choice["index"]),
                prompt_token_ids=prompt,
                token_ids=tokens,
                logprobs=sampled,
                finish_reason=finish_reason(choice.get("finish_reason")),
                stop_reason=choice.get("stop_reason"),
                top_logprobs=top,
                prompt_logprobs=prompt_lps,
                prompt_top_logprobs=prompt_top,
                latency_s=latency_s,
                token_versions=expand_versions(choice.get("weight_versions"), len(tokens), live_version),
            )
        )
    return result


def delta(request_id: str, choice: Mapping[str, Any], k: int, versions: tuple[int, ...]) -> CompletionDelta:
    """One streaming increment from a stream chunk's choice."""
    reason = choice.get("finish_reason")
    sampled, _ = _logprobs(choice, k)
    return CompletionDelta(
        request_id=request_id,
        index=int(choice["index"]),
        token_ids=tuple(choice.get("token_ids") or ()),
        logprobs=sampled,
        finish_reason=finish_reason(reason) if reason is not None else None,
        stop_reason=choice.get("stop_reason") if reason is not None else None,
        token_versions=versions,
    )


def raise_stream_error(chunk: Mapping[str, Any]) -> None:
    """An error vLLM reported inside a stream (``data: {"error": ...}``)."""
    error = chunk.get("error")
    if error is None:
        return
    message = error.get("message", error) if isinstance(error, Mapping) else error
    code = error.get("code") if isinstance(error, Mapping) else None
    if isinstance(code, int) and 400 <= code < 500:
        raise InvalidRequest(str(error.get("param") or "request"), f"the vLLM server refused the stream: {message}")
    raise RuntimeError(f"the vLLM server failed the stream: {message}")
