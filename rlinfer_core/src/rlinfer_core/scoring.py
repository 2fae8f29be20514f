"""Scoring (capability ``score``): logprobs of given completion tokens under the current weights,
by teacher forcing through the engine, without sampling (what the peers call ``compute_logp``).

Built by the facade on generate with ``prompt_logprobs``: the request's prompt is
``prompt_token_ids + completion_token_ids``, one greedy token is generated (and discarded) and the
prompt logprobs of the completion positions are the scores. So ``score`` is claimed wherever a
backend claims ``generate.prompt_logprobs``, and is exact on every backend that passes the kit's
prompt-logprob parity test.

Semantics: ``log p(completion[i] | prompt, completion[:i])`` under ``log_softmax`` of the model's
own logits - the ``raw`` logprobs mode (no temperature, penalties, bias or truncation). This equals
the ``processed`` logprob of a request sampled at temperature 1 without penalties, bias or
truncation, and the logprob greedy generation reports. A policy sampled at another temperature
needs ``log_softmax(logits / T)``, which cannot be derived from these numbers: use the sampled
completion's own ``logprobs`` for the behaviour policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core import _validate as v
from rlinfer_core.errors import InvalidRequest, RLInferError
from rlinfer_core.multimodal import Image, to_images
from rlinfer_core.types import Capability, GenerateRequest, SamplingParams, new_request_id

if TYPE_CHECKING:
    from rlinfer_core.engine import AsyncEngine


@attrs.frozen
class ScoreRequest:
    """Tokens to score: ``completion_token_ids`` after ``prompt_token_ids`` (both non-empty)."""

    prompt_token_ids: tuple[int, ...] = attrs.field(converter=v.to_tuple, validator=v.int_items())
    completion_token_ids: tuple[int, ...] = attrs.field(converter=v.to_tuple, validator=v.int_items())
    request_id: str = attrs.field(factory=new_request_id)
    #: adapter to score under (capability ``lora``); None: the base weights
    lora: str | None = None
    #: the prompt's images (capability generate.multimodal), as in GenerateRequest.images: the
    #: prompt holds one placeholder or the expanded run per image; Score.prompt_token_ids are expanded
    images: tuple[Image, ...] = attrs.field(default=(), converter=to_images)

    def __attrs_post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequest("prompt_token_ids", "must hold at least one token id (the first has no logprob)")
        if not self.completion_token_ids:
            raise InvalidRequest("completion_token_ids", "must hold at least one token id")


@attrs.frozen
class Score:
    """``logprobs[i]`` = log p(completion_token_ids[i] | everything before it), raw mode."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_version: int  #: the weights that computed every logprob (one forward pass)


def _as_requests(requests: Any) -> list[ScoreRequest]:
    batch = [requests] if isinstance(requests, ScoreRequest) else list(requests)
    for r in batch:
        if not isinstance(r, ScoreRequest):
            raise InvalidRequest("requests", f"must be ScoreRequest objects, got {type(r).__name__}")
    return batch


def to_generate(request: ScoreRequest) -> GenerateRequest:
    """The generate request that scores ``request`` (greedy, one token, prompt logprobs)."""
    fields: dict[str, Any] = {}
    if request.lora is not None:
        fields["lora"] = request.lora
    return GenerateRequest(
        prompt_token_ids=request.prompt_token_ids + request.completion_token_ids,
        sampling=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True, ignore_eos=True),
        request_id=request.request_id,
        images=request.images,
        **fields,
    )


async def score(engine: AsyncEngine, requests: ScoreRequest | Sequence[ScoreRequest]) -> list[Score]:
    """Score a batch through ``engine`` (see the module docstring); one Score per request, in order."""
    batch = _as_requests(requests)
    engine.capabilities.require(Capability.SCORE)
    completions = await engine.generate([to_generate(r) for r in batch])
    out = []
    for request, completion in zip(batch, completions, strict=True):
        prompt_logprobs = completion.prompt_logprobs
        prompt = request.prompt_token_ids
        if request.images:  # the engine expanded the image placeholders
            prompt = completion.prompt_token_ids[: len(completion.prompt_token_ids) - len(request.completion_token_ids)]
        start = len(prompt)
        total = start + len(request.completion_token_ids)
        if prompt_logprobs is None or len(prompt_logprobs) != total:
            got = None if prompt_logprobs is None else len(prompt_logprobs)
            raise RLInferError(
                f"backend {engine.backend_name!r} returned {got} prompt logprobs for a prompt of {total} tokens "
                "(a contract violation)"
            )
        logprobs = tuple(float(x) for x in prompt_logprobs[start:] if x is not None)
        versions = completion.token_versions or (completion.weight_version,)
        out.append(Score(request.request_id, prompt, request.completion_token_ids, logprobs, versions[0]))
    return out
