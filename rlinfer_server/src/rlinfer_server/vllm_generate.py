"""vLLM's token-in endpoint ``/inference/v1/generate`` over an rlinfer engine: ``token_ids`` and
vLLM ``sampling_params`` in; per choice ``token_ids``, ``finish_reason``, ``stop_reason``,
``logprobs.content[{token_id, logprob, top_logprobs}]`` and ``weight_versions`` spans out
(``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``).

Routes as vLLM gives them: no per-request switch; on an engine started with
``enable_routed_experts`` (capability generate.routed_experts) every choice has ``routed_experts``,
base64 of ``.npy`` bytes (``np.load(io.BytesIO(base64.b64decode(s)))``) of an int32 array
``[prompt + output - 1 - routed_experts_prompt_start, layers, top_k]``
(:func:`rlinfer_core.routing.engine_rows`); -1 marks a position without a route."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import Completion, GenerateRequest, SamplingParams
from rlinfer_server.convert import stop_strings, top_k_off_as_minus_one
from rlinfer_server.schemas import Body
from rlinfer_server.sglang_generate import version_spans


class VllmSamplingParams(Body):
    """The vLLM SamplingParams fields RL clients send (TRL, SkyRL, verl), at vLLM's defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: int | None = None  # TRL's FINAL_ONLY (2): answers are final-only here anyway
    include_stop_str_in_output: bool = False
    prompt_logprobs: None = None
    spaces_between_special_tokens: Literal[True] = True
    #: the first position of ``routed_experts`` (in [0, prompt tokens])
    routed_experts_prompt_start: int = 0


class VllmGenerateBody(Body):
    """``POST /inference/v1/generate``."""

    token_ids: list[int]
    sampling_params: VllmSamplingParams
    request_id: str | None = None
    model: str | None = None
    stream: Literal[False] | None = False
    output_mode: Literal["tokens"] = "tokens"
    return_token_ids: bool | None = None
    cache_salt: str | None = None  # a prefix-cache namespace (SkyRL: the weight version); not needed here
    priority: int = 0  # lower first (capability generate.priority)
    features: None = None
    kv_transfer_params: None = None


def generate_requests(body: VllmGenerateBody, routes: bool = False) -> GenerateRequest:
    """The GenerateRequest of a body (checked before anything reaches the engine); ``routes``: the
    engine captures routed experts, so the request asks for them (vLLM's server-wide switch)."""
    if not body.token_ids:
        raise InvalidRequest("token_ids", "must not be empty")
    p = body.sampling_params
    if not 0 <= p.routed_experts_prompt_start <= len(body.token_ids):
        raise InvalidRequest(
            "sampling_params.routed_experts_prompt_start",
            f"must be in [0, {len(body.token_ids)}] (the prompt), got {p.routed_experts_prompt_start}",
        )
    if p.max_tokens is None:
        raise InvalidRequest("sampling_params.max_tokens", "must be given (rlinfer bounds every request)")
    stop = stop_strings(p.stop)
    try:
        sampling = SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=top_k_off_as_minus_one(p.top_k),
            min_p=p.min_p,
            max_tokens=p.max_tokens,
            min_tokens=p.min_tokens,
            seed=p.seed,
            stop=tuple(stop),
            include_stop_str_in_output=p.include_stop_str_in_output,
            stop_token_ids=tuple(p.stop_token_ids or ()),
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs or 0,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            return_routed_experts=routes,
        )
    except InvalidRequest as exc:
        field = exc.field.removeprefix("sampling.")
        raise InvalidRequest(f"sampling_params.{field}", str(exc).removeprefix(f"invalid {exc.field}: ")) from None
    return GenerateRequest(
        prompt_token_ids=body.token_ids,
        sampling=sampling,
        request_id=body.request_id or uuid.uuid4().hex,
        priority=body.priority,
    )


def _logprobs(c: Completion, top: int | None) -> dict[str, Any] | None:
    if top is None:
        return None
    content = []
    for i, (token, logprob) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        alternatives = sorted((c.top_logprobs[i] if c.top_logprobs else {}).items(), key=lambda kv: -kv[1])
        content.append(
            {
                "token_id": token,
                "logprob": logprob,
                "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in alternatives[:top]],
            }
        )
    return {"content": content}


def routes_npy_base64(c: Completion, start: int) -> str | None:
    """vLLM's ``routed_experts``: base64 of the ``.npy`` bytes of the rows ``[start, tokens - 1)``."""
    if c.routed_experts is None:
        return None
    import base64
    import io

    import numpy as np

    from rlinfer_core.routing import engine_rows

    buffer = io.BytesIO()
    np.save(buffer, engine_rows(c.routed_experts, start), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def generate_answer(
    body: VllmGenerateBody, request: GenerateRequest, completions: Sequence[Completion], model: str
) -> dict[str, Any]:
    """vLLM's ``GenerateResponse`` (tokens mode) for the completions of one request."""
    choices = []
    for c in sorted(completions, key=lambda c: c.index):
        versions = c.token_versions or (c.weight_version,) * len(c.token_ids)
        choices.append(
            {
                "index": c.index,
                "finish_reason": str(c.finish_reason),
                "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids),
                "logprobs": _logprobs(c, body.sampling_params.logprobs),
                "routed_experts": routes_npy_base64(c, body.sampling_params.routed_experts_prompt_start),
                "weight_versions": version_spans(versions),
            }
        )
    prompt = len(request.prompt_token_ids or ())
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "request_id": request.request_id,
        "model": body.model or model,
        "created": int(time.time()),
        "choices": choices,
        "prompt_token_ids": list(request.prompt_token_ids or ()),
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
