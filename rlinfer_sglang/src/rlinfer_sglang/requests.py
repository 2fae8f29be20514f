"""rlinfer requests as SGLang's ``GenerateReqInput`` fields (a dict per sample, the same for both
transports: the in-process one builds the object from it, the HTTP one posts it as JSON to
``/generate``); no SGLang import."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlinfer_core.types import GenerateRequest, LogprobsMode
from rlinfer_sglang.agent import structured_params


def sampling_params(
    request: GenerateRequest, prompt_len: int, max_model_len: int, vocab_size: int | None = None
) -> dict[str, Any]:
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
    if s.stop_regex:
        params["stop_regex"] = list(s.stop_regex)
    if s.include_stop_str_in_output:
        params["no_stop_trim"] = True
    if s.min_p > 0.0:
        params["min_p"] = s.min_p
    if renormalises(request) and vocab_size:
        # SGLang's sampling mask needs a finite top_k; the vocabulary size truncates nothing
        params["top_k"] = vocab_size if s.top_k < 1 else min(s.top_k, vocab_size)
    custom = custom_params(request)
    if custom:
        params["custom_params"] = custom
    params.update(structured_params(s.structured))
    return params


def priority_sign(args: Any) -> int | None:
    """How rlinfer's priorities (lower first) map onto an SGLang engine's: 1 when it schedules low
    values first, -1 when high values first (SGLang's default), None when it runs without priority
    scheduling. ``args``: its ServerArgs, or the ``/server_info`` dict."""

    def get(key: str) -> Any:
        return args.get(key) if isinstance(args, Mapping) else getattr(args, key, None)

    if not get("enable_priority_scheduling"):
        return None
    return 1 if get("schedule_low_priority_values_first") else -1


def priority_arg(request: GenerateRequest, sign: int | None) -> dict[str, Any]:
    """``GenerateReqInput``'s ``priority`` for ``request`` ({} without priority scheduling, where
    SGLang aborts a request that names one). Sent for every request where it is on: SGLang puts a
    request without one behind all others."""
    return {} if sign is None else {"priority": sign * request.priority}


def priority_groups(requests: Sequence[GenerateRequest]) -> list[list[int]]:
    """Indices of ``requests`` grouped by priority, in order of first appearance (a batched SGLang
    call carries one priority for all its items)."""
    groups: dict[int, list[int]] = {}
    for k, request in enumerate(requests):
        groups.setdefault(request.priority, []).append(k)
    return list(groups.values())


def custom_params(request: GenerateRequest) -> dict[str, Any]:
    """Parameters of rlinfer's logits processor (:mod:`rlinfer_sglang.scheduler.logits`); {} when unused."""
    s = request.sampling
    out: dict[str, Any] = {}
    if s.repetition_penalty != 1.0:
        out["rlinfer_rep"] = s.repetition_penalty
    if s.presence_penalty:
        out["rlinfer_presence"] = s.presence_penalty
    if s.frequency_penalty:
        out["rlinfer_frequency"] = s.frequency_penalty
    if s.logit_bias:
        out["rlinfer_bias_ids"] = [t for t, _ in s.logit_bias]
        out["rlinfer_bias"] = [float(b) for _, b in s.logit_bias]
    if s.allowed_token_ids is not None:
        out["rlinfer_allowed"] = list(s.allowed_token_ids)
    return out


def renormalises(request: GenerateRequest) -> bool:
    """True when the processed logprobs must be renormalised after truncation (SGLang's
    ``return_sampling_mask`` gives the sampled token's logprob in the truncated distribution)."""
    s = request.sampling
    return s.logprobs_mode is LogprobsMode.PROCESSED and not s.greedy and s.truncates and s.top_k != 1


def point_mass(request: GenerateRequest) -> bool:
    """True for sampled top_k=1: the processed distribution is all on the argmax (logprob 0);
    SGLang refuses its sampling mask for it."""
    s = request.sampling
    return s.logprobs_mode is LogprobsMode.PROCESSED and not s.greedy and s.top_k == 1


def logprob_args(request: GenerateRequest, processor: str | None = None) -> dict[str, Any]:
    """``GenerateReqInput`` keyword arguments for the logprobs and processing ``request`` needs.

    ``processor``: the serialized rlinfer logits processor, used when the request needs it.
    """
    s = request.sampling
    args: dict[str, Any] = {
        "return_logprob": True,
        # from 0, SGLang also matches no cached prefix: every prompt position is computed, so
        # prompt hidden states cover the whole prompt
        "logprob_start_len": 0 if s.prompt_logprobs or s.prompt_hidden_states else -1,
        # one count for output and prompt positions: the larger, each cut to its own on return
        "top_logprobs_num": max(s.logprobs, s.prompt_top_logprobs),
        "custom_logit_processor": processor if custom_params(request) else None,
        "return_sampling_mask": renormalises(request),
    }
    return args


def sample_body(
    request: GenerateRequest,
    ids: Sequence[int],
    params: dict[str, Any],
    rid: str,
    processor: str,
    stream: bool,
    priority_sign: int | None = None,
    lora_path: str | None = None,
    extra_key: str | None = None,
) -> dict[str, Any]:
    """The ``GenerateReqInput`` fields of one sample (``ids``: as :func:`rlinfer_sglang.images.engine_input`
    collapses them is the caller's; optional fields only where set, so any SGLang version reads it).
    ``extra_key``: the radix-cache namespace of the weights serving it (:func:`cache_key`)."""
    body: dict[str, Any] = {
        "input_ids": list(ids),
        "sampling_params": params,
        "rid": rid,
        "stream": stream,
        "return_hidden_states": request.sampling.return_hidden_states,
        **logprob_args(request, processor),
        **priority_arg(request, priority_sign),
    }
    if request.sampling.return_routed_experts:
        body["return_routed_experts"] = True
    if lora_path is not None:
        body["lora_path"] = lora_path
    if extra_key is not None:
        body["extra_key"] = extra_key
    return body


#: fields a batched body carries once for all its samples (callers batch one priority at a time)
BATCH_SCALARS = ("stream", "priority")
#: fields a batched body carries once, set when any sample sets them
BATCH_ANY = ("return_routed_experts",)
#: per-sample fields only some samples carry, and what a batched body gives the others
BATCH_OPTIONAL: dict[str, Any] = {"image_data": [], "lora_path": None}


def batch_body(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``GenerateReqInput`` for several samples (SGLang's batched form: a list per field), so
    the scheduler sees the whole batch at once."""
    if len(samples) == 1:
        return dict(samples[0])
    once = BATCH_SCALARS + BATCH_ANY
    keys = [k for k in samples[0] if k not in once]
    keys += [k for k in BATCH_OPTIONAL if k not in keys and any(k in s for s in samples)]
    scalars = {k: samples[0][k] for k in BATCH_SCALARS if k in samples[0]}
    scalars |= {k: True for k in BATCH_ANY if any(s.get(k) for s in samples)}
    fields = {k: [s[k] if k in s else BATCH_OPTIONAL[k] for s in samples] for k in keys}
    return {**fields, **scalars, "stream": False}


def score_body(
    prompt: Sequence[int], tokens: Sequence[int], start: int, top: int, rid: str, extra_key: str | None = None
) -> dict[str, Any]:
    """A prefill that scores ``prompt + tokens``: its input-token logprobs are ``log_softmax`` of the
    raw logits for ``tokens[start:]`` (SGLang reports output logprobs after its processing)."""
    return {
        **({} if extra_key is None else {"extra_key": extra_key}),
        "input_ids": [*prompt, *tokens],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "rid": rid,
        "return_logprob": True,
        "logprob_start_len": len(prompt) + start - 1,  # SGLang leaves the first position out
        "top_logprobs_num": top,
    }


def bench_body(requests: Sequence[GenerateRequest]) -> dict[str, Any] | None:
    """The raw-generate baseline: the batch's samples with hand-built sampling params and no rlinfer
    processing (None for no sample)."""
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
        return None
    return {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "top_logprobs_num": top}


#: how every rlinfer cache key starts: SGLang appends a LoRA id (and other namespaces) after it
CACHE_KEY_PREFIX = "rlinfer-v"


def cache_key(version: int) -> str:
    """SGLang's ``extra_key`` for requests served by weight version ``version``: SGLang keys its
    radix cache by it, so a prefix that older weights computed never matches a newer request and an
    update needs no cache flush. Ends with ";" so that a suffix SGLang appends stays apart from the
    number (:func:`rekeyed`)."""
    return f"{CACHE_KEY_PREFIX}{version};"


def rekeyed(key: str | None, new: str) -> str | None:
    """``key`` with its rlinfer part replaced by ``new`` (kept as it is when rlinfer did not set it)."""
    if key is None or not key.startswith(CACHE_KEY_PREFIX) or ";" not in key:
        return key
    return new + key.split(";", 1)[1]


def label(version: int) -> str:
    """SGLang's weight-version label for rlinfer version ``version`` (SGLang labels are strings)."""
    return str(version)
