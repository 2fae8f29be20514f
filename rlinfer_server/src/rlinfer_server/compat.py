"""vLLM's request fields that rlinfer serve accepts but does not implement.

A field vLLM's OpenAI server accepts is never an "unknown field" here: clients written for vLLM
(AReaL, verifiers, TRL...) send several of them explicitly at their neutral values (``"use_beam_search":
false``, ``"priority": 0``). Such a value is accepted; any other value is refused with a 400 naming the
field and saying why, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_server.schemas import Body


@attrs.frozen
class Unsupported:
    """A vLLM field rlinfer serve does not implement: the values that mean "off", and why."""

    neutral: tuple[Any, ...]
    reason: str


_NO_MM = "rlinfer serves text models; there is no multimodal input"
_ENGINE = "not part of rlinfer's engine contract (the same on every backend)"

#: field -> the values accepted (None always is) and the reason any other value is refused
UNSUPPORTED: Mapping[str, Unsupported] = {
    "use_beam_search": Unsupported((False,), "beam search is not part of rlinfer's sampling contract"),
    "length_penalty": Unsupported((1.0, 1), "only used by beam search, which is not supported"),
    "watermarking": Unsupported((False,), _ENGINE),
    "truncate_prompt_tokens": Unsupported((), "prompts are never truncated: rlinfer serves the exact prompt tokens"),
    "truncation_side": Unsupported((), "prompts are never truncated: rlinfer serves the exact prompt tokens"),
    "logprob_token_ids": Unsupported(([],), "per-request logprob token sets are not part of the contract"),
    "bad_words": Unsupported(([],), "use logit_bias or allowed_token_ids"),
    "cache_salt": Unsupported((), "prefix-cache salting is not part of the contract"),
    "kv_transfer_params": Unsupported((), "disaggregated serving is not part of the contract"),
    "ec_transfer_params": Unsupported((), "disaggregated serving is not part of the contract"),
    "vllm_xargs": Unsupported(({},), "vLLM's custom extension arguments have no engine-neutral meaning"),
    "repetition_detection": Unsupported((), _ENGINE),
    "thinking_token_budget": Unsupported((), "no reasoning parser runs in rlinfer serve"),
    "routed_experts_prompt_start": Unsupported(
        (0,), "routes (return_routed_experts) always cover the whole prompt; slice them client-side"
    ),
    "return_token_offsets": Unsupported((False,), "token offsets are not returned"),
    "mm_payload": Unsupported(("tensors", "none"), _NO_MM),
    "return_mm_kwargs": Unsupported((True, False), _NO_MM),
    "spaces_between_special_tokens": Unsupported((True,), "text is the tokenizer's plain decode of token_ids"),
    "media_io_kwargs": Unsupported(({},), _NO_MM),
    "mm_processor_kwargs": Unsupported(({},), _NO_MM),
    "prompt_embeds": Unsupported((), "prompts are token ids or text"),
    "reasoning_effort": Unsupported((), "no reasoning parser runs in rlinfer serve"),
    "echo": Unsupported((False,), "the prompt's token ids are in prompt_token_ids"),
}

#: vLLM fields accepted with any value and ignored: ``session_id`` (a routing hint; a pool routes
#: by its own policy), ``stream_interval`` (every engine delta is sent), ``include_stop_str_in_output``
#: (text is always the decode of token_ids, so a matched stop string is in it)
IGNORED = frozenset({"session_id", "stream_interval", "include_stop_str_in_output"})


def refuse_unsupported(body: Body) -> None:
    """InvalidRequest naming the first field of ``body`` that vLLM accepts and rlinfer does not
    implement, when it is set to anything but a neutral value."""
    for field in body.model_fields_set:
        rule = UNSUPPORTED.get(field)
        if rule is None:
            continue
        value = getattr(body, field)
        if value is None or any(value == ok and type(value) is type(ok) for ok in rule.neutral):
            continue
        if isinstance(value, float) and any(isinstance(ok, int | float) and value == ok for ok in rule.neutral):
            continue
        raise InvalidRequest(field, f"is not supported by rlinfer serve ({rule.reason}); got {value!r}")
