"""verl's token-in/token-out request (a sampling dict) as an rlinfer request, and the answer as
verl's ``TokenOutput``.

Follows verl 0.9's vLLM server (``vLLMHttpServer.generate``): ``max_tokens`` (or SGLang's
``max_new_tokens``) when given, else the room left by ``prompt_length + response_length``, capped
by ``response_length`` and the context; ``logprobs`` (a bool) asks for the sampled tokens'
logprobs; ``prompt_logprobs`` (an int) for the prompt's, returned in ``extra_fields`` as verl's
``prompt_ids`` / ``prompt_logprobs`` rows. A key that is neither verl's nor a SamplingParams field
is refused (InvalidRequest naming it), never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import Completion, EngineConfig, FinishReason, SamplingParams

#: verl's sampling keys handled here rather than passed as SamplingParams fields
VERL_KEYS = frozenset({"max_tokens", "max_new_tokens", "logprobs", "prompt_logprobs"})
_FIELDS = frozenset(f.name for f in attrs.fields(SamplingParams))


@attrs.frozen
class VerlRequest:
    """One verl request translated: its SamplingParams and what the answer must carry."""

    sampling: SamplingParams
    want_logprobs: bool
    #: verl's prompt_logprobs (top-k per prompt position; 0: the prompt token's own); None: not asked
    prompt_logprobs: int | None


def max_new_tokens(params: dict[str, Any], prompt_len: int, config: EngineConfig) -> int:
    """verl's length rule (pops ``max_tokens`` / ``max_new_tokens`` from ``params``)."""
    response = config.max_response_tokens
    if "max_tokens" in params:
        wanted = int(params.pop("max_tokens"))
        params.pop("max_new_tokens", None)
    elif "max_new_tokens" in params:
        wanted = int(params.pop("max_new_tokens"))
    elif response is not None:
        prompt = config.max_prompt_tokens
        wanted = response if prompt is None else min(response, prompt + response - prompt_len)
    else:
        wanted = config.default_sampling.max_tokens
    if config.max_model_len is not None:
        room = config.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequest(
                "prompt_ids",
                f"the prompt ({prompt_len} tokens) leaves no room to generate within max_model_len "
                f"({config.max_model_len})",
            )
        wanted = min(wanted, room)
    if response is not None:
        wanted = min(wanted, response)
    return max(1, wanted)


def verl_request(
    sampling_params: Mapping[str, Any],
    prompt_len: int,
    config: EngineConfig,
    seed: int | None = None,
    routed: bool = False,
) -> VerlRequest:
    """verl's ``sampling_params`` dict as a VerlRequest on top of the engine's default sampling;
    ``seed``: verl's per-replica seed under ``full_determinism`` (used unless the dict has one);
    ``routed``: verl's ``enable_rollout_routing_replay`` (every request returns its routes)."""
    params = dict(sampling_params)
    max_tokens = max_new_tokens(params, prompt_len, config)
    want_logprobs = bool(params.pop("logprobs", False))
    prompt_logprobs = params.pop("prompt_logprobs", None)
    if prompt_logprobs is not None and (
        isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int) or prompt_logprobs < 0
    ):
        raise InvalidRequest("prompt_logprobs", f"must be a number of top logprobs >= 0, got {prompt_logprobs!r}")
    unknown = sorted(set(params) - _FIELDS)
    if unknown:
        raise InvalidRequest(
            unknown[0], f"not a sampling key verl or rlinfer knows; allowed: {sorted(VERL_KEYS | _FIELDS)}"
        )
    if seed is not None:
        params.setdefault("seed", seed)
    # verl repeats each prompt rollout.n times itself (one generate call per sample); the section's
    # `n` is the engine's default for rlinfer's own callers
    params.setdefault("n", 1)
    for key in ("temperature", "top_p", "repetition_penalty", "min_p", "presence_penalty", "frequency_penalty"):
        if isinstance(params.get(key), int) and not isinstance(params[key], bool):
            params[key] = float(params[key])  # verl writes temperature=0 for greedy
    if routed:
        params.setdefault("return_routed_experts", True)
    if prompt_logprobs is not None:
        params["prompt_logprobs"] = True
        params["prompt_top_logprobs"] = prompt_logprobs
    sampling = config.sampling(max_tokens=max_tokens, **params)
    return VerlRequest(sampling=sampling, want_logprobs=want_logprobs, prompt_logprobs=prompt_logprobs)


def stop_reason(finish: FinishReason) -> str:
    """verl's stop reason: ``completed`` (EOS, stop token or length) or ``aborted``."""
    return "aborted" if finish is FinishReason.ABORT else "completed"


def prompt_logprob_rows(completion: Completion, k: int) -> dict[str, list[list[Any]]]:
    """verl's ``prompt_ids`` / ``prompt_logprobs`` rows (vLLM's ``extract_prompt_logprobs``
    contract): one row per prompt position after the first, ``max(k, 1)`` wide (k = 0: the prompt
    token itself; else the top k, best first), and a trailing dummy row, so ``len == len(prompt)``."""
    prompt = completion.prompt_token_ids
    ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    for position in range(1, len(prompt)):
        if k == 0:
            own = (completion.prompt_logprobs or ())[position]
            ids.append([int(prompt[position])])
            logprobs.append([float(own if own is not None else 0.0)])
        else:
            top: Mapping[int, float] = (completion.prompt_top_logprobs or ())[position] or {}
            ranked = sorted(top.items(), key=lambda item: -item[1])[:k]
            ids.append([int(t) for t, _ in ranked])
            logprobs.append([float(lp) for _, lp in ranked])
    width = max(k, 1)
    ids.append([0] * width)
    logprobs.append([0.0] * width)
    return {"prompt_ids": ids, "prompt_logprobs": logprobs}


def token_output_fields(completion: Completion, request: VerlRequest, global_steps: int | None) -> dict[str, Any]:
    """The fields of verl's ``TokenOutput`` for one completion (``num_preempted`` is None: the
    engines do not report preemptions through rlinfer)."""
    extra: dict[str, Any] = {"global_steps": global_steps, "weight_version": completion.weight_version}
    if request.prompt_logprobs is not None:
        extra.update(prompt_logprob_rows(completion, request.prompt_logprobs))
    routed = completion.routed_experts.array() if completion.routed_experts is not None else None
    return {
        "token_ids": list(completion.token_ids),
        "log_probs": list(completion.logprobs) if request.want_logprobs else None,
        "routed_experts": routed,
        "stop_reason": stop_reason(completion.finish_reason),
        "num_preempted": None,
        "extra_fields": extra,
    }


def as_token_ids(prompt_ids: Sequence[int] | Any) -> list[int]:
    """verl's prompt ids (a list, a numpy array or a tensor) as a list of ints."""
    if hasattr(prompt_ids, "tolist"):
        prompt_ids = prompt_ids.tolist()
    return [int(t) for t in prompt_ids]
