"""Sampling parameters: :class:`SamplingParams` and :class:`LogprobsMode`, validated where built.

Re-exported by :mod:`rlinfer_core.types` (import them from there).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any

import attrs

from rlinfer_core import _validate as v
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.structured import StructuredOutput, to_structured

MAX_TOP_LOGPROBS = 20
MAX_N = 256
#: at most this many stop_regex patterns, each at most MAX_STOP_REGEX_BYTES long (SGLang's limits)
MAX_STOP_REGEX = 32
MAX_STOP_REGEX_BYTES = 256


class LogprobsMode(enum.StrEnum):
    """Which distribution the returned logprobs are taken from (the same on every backend).

    PROCESSED (default): the distribution the token was sampled from - logits after penalties,
    logit bias / allowed tokens and temperature, then truncated by top_k, top_p and min_p and
    renormalised over the tokens that could be sampled. This is the behaviour policy an
    importance ratio needs. Greedy requests (temperature 0) report ``log_softmax`` of the
    processed logits at temperature 1, untruncated.
    RAW: ``log_softmax`` of the model's own logits, before any processing (no temperature).
    """

    PROCESSED = "processed"
    RAW = "raw"


def _to_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for i, item in enumerate(items):
        try:
            token, bias = item
        except (TypeError, ValueError):
            raise InvalidRequest("logit_bias", f"item {i} must be a (token_id, bias) pair, got {item!r}") from None
        out.append((token, bias))
    return tuple(sorted(out, key=lambda pair: pair[0] if isinstance(pair[0], int) else -1))


def _check_logit_bias(_inst: Any, _attribute: Any, value: tuple[tuple[int, float], ...]) -> None:
    tokens = [token for token, _ in value]
    if len(set(tokens)) != len(tokens):
        raise InvalidRequest("logit_bias", "each token id may appear once")
    for token, bias in value:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequest("logit_bias", f"token ids must be integers >= 0, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= float(bias) <= 100.0:
            raise InvalidRequest("logit_bias", f"bias of token {token} must be a number in [-100, 100], got {bias!r}")


def _to_logprobs_mode(value: Any) -> LogprobsMode:
    try:
        return LogprobsMode(value)
    except ValueError:
        raise InvalidRequest(
            "logprobs_mode", f"must be one of {[m.value for m in LogprobsMode]}, got {value!r}"
        ) from None


def _check_stop_regex(_inst: Any, _attribute: Any, value: tuple[str, ...]) -> None:
    if len(value) > MAX_STOP_REGEX:
        raise InvalidRequest("stop_regex", f"at most {MAX_STOP_REGEX} patterns, got {len(value)}")
    for i, pattern in enumerate(value):
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequest("stop_regex", f"item {i} must be a non-empty string, got {pattern!r}")
        if len(pattern.encode()) > MAX_STOP_REGEX_BYTES:
            raise InvalidRequest("stop_regex", f"item {i} must be at most {MAX_STOP_REGEX_BYTES} bytes long")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise InvalidRequest("stop_regex", f"item {i} ({pattern!r}) does not compile: {exc}") from None
        if compiled.search("") is not None:
            raise InvalidRequest(
                "stop_regex", f"item {i} ({pattern!r}) matches the empty string (it would stop at once)"
            )


def _to_optional_ids(value: Any) -> tuple[int, ...] | None:
    return None if value is None else v.to_tuple(value)


@attrs.frozen
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy.

    ``logprobs`` is the number of top alternatives to return per generated token; the sampled
    token's own logprob is always returned, from the distribution ``logprobs_mode`` names (by
    default the one it was sampled from), which is what an RL loss needs.

    Processing order (both backends): penalties (repetition, then presence/frequency over the
    generated tokens), ``logit_bias`` and ``allowed_token_ids``, temperature, then top_k, top_p and
    min_p truncation.
    """

    temperature: float = attrs.field(default=1.0, validator=v.in_range(0.0, 100.0))
    top_p: float = attrs.field(default=1.0, validator=v.in_range(0.0, 1.0, low_open=True))
    top_k: int = attrs.field(default=-1, validator=v.in_range(-1, 1_000_000, integer=True))
    max_tokens: int = attrs.field(default=16, validator=v.in_range(1, 1_000_000, integer=True))
    min_tokens: int = attrs.field(default=0, validator=v.in_range(0, 1_000_000, integer=True))
    n: int = attrs.field(default=1, validator=v.in_range(1, MAX_N, integer=True))
    seed: int | None = attrs.field(default=None, validator=v.in_range(0, 2**31 - 1, integer=True, allow_none=True))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=v.to_tuple, validator=v.int_items())
    stop: tuple[str, ...] = attrs.field(default=(), converter=v.to_tuple, validator=v.non_empty_strings)
    #: Python regular expressions searched in the output text as it grows: the output ends at the
    #: token that completes the first match (capability generate.stop_regex); stop_reason is the
    #: pattern, and ``text`` is cut where the match starts (see include_stop_str_in_output)
    stop_regex: tuple[str, ...] = attrs.field(default=(), converter=v.to_tuple, validator=_check_stop_regex)
    #: keep the matched stop string (or stop_regex match) at the end of Completion.text; token_ids
    #: hold the tokens that completed the match either way
    include_stop_str_in_output: bool = attrs.field(
        default=False, validator=v.instance_of(bool, "a bool (True or False)")
    )
    ignore_eos: bool = attrs.field(default=False, validator=v.instance_of(bool, "a bool (True or False)"))
    logprobs: int = attrs.field(default=0, validator=v.in_range(0, MAX_TOP_LOGPROBS, integer=True))
    prompt_logprobs: bool = attrs.field(default=False, validator=v.instance_of(bool, "a bool (True or False)"))
    #: top alternatives per prompt position (with prompt_logprobs), for teacher scoring
    prompt_top_logprobs: int = attrs.field(default=0, validator=v.in_range(0, MAX_TOP_LOGPROBS, integer=True))
    #: drop tokens whose probability is below min_p times the most likely one's (0: off)
    min_p: float = attrs.field(default=0.0, validator=v.in_range(0.0, 1.0))
    #: divides positive logits (multiplies negative ones) of tokens seen in prompt or output (1: off)
    repetition_penalty: float = attrs.field(default=1.0, validator=v.in_range(0.0, 10.0, low_open=True))
    #: subtracted once from the logit of every token already generated (0: off)
    presence_penalty: float = attrs.field(default=0.0, validator=v.in_range(-2.0, 2.0))
    #: subtracted per occurrence from the logit of every token already generated (0: off)
    frequency_penalty: float = attrs.field(default=0.0, validator=v.in_range(-2.0, 2.0))
    #: added to the logits of these token ids; a Mapping or (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(
        default=(), converter=_to_logit_bias, validator=_check_logit_bias
    )
    #: only these token ids may be sampled (None: all)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=_to_optional_ids, validator=attrs.validators.optional(v.int_items())
    )
    logprobs_mode: LogprobsMode = attrs.field(default=LogprobsMode.PROCESSED, converter=_to_logprobs_mode)
    #: constrain the output to a JSON schema, a regex, a choice (capability generate.structured) or
    #: an EBNF grammar (generate.structured and generate.grammar_ebnf)
    structured: StructuredOutput | None = attrs.field(default=None, converter=to_structured)
    #: return Completion.routed_experts, the experts each token was routed to (capability
    #: generate.routed_experts; alignment in :mod:`rlinfer_core.routing`)
    return_routed_experts: bool = attrs.field(default=False, validator=v.instance_of(bool, "a bool (True or False)"))
    #: return Completion.hidden_states, the final-layer hidden state that produced each generated
    #: token (capability generate.hidden_states; alignment in :mod:`rlinfer_core.hidden_states`)
    return_hidden_states: bool = attrs.field(default=False, validator=v.instance_of(bool, "a bool (True or False)"))
    #: also return Completion.prompt_hidden_states, one row per prompt position (needs
    #: return_hidden_states)
    prompt_hidden_states: bool = attrs.field(default=False, validator=v.instance_of(bool, "a bool (True or False)"))

    def __attrs_post_init__(self) -> None:
        if self.top_k == 0:
            raise InvalidRequest("top_k", "must be -1 (disabled) or >= 1, got 0")
        if self.prompt_top_logprobs and not self.prompt_logprobs:
            raise InvalidRequest("prompt_top_logprobs", "needs prompt_logprobs=True")
        if self.prompt_hidden_states and not self.return_hidden_states:
            raise InvalidRequest("prompt_hidden_states", "needs return_hidden_states=True")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids", "must hold at least one token id (or be None)")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """True when top_k, top_p or min_p cut the sampling distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def penalised(self) -> bool:
        """True when a repetition, presence or frequency penalty is set."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def biased(self) -> bool:
        """True when logit_bias or allowed_token_ids is set."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None
