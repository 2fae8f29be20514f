"""OpenAI request bodies -> rlinfer GenerateRequests, and Completions -> OpenAI responses.

Extensions on every choice (ignored by OpenAI clients, in ``choice.model_extra`` of the ``openai``
package): ``token_ids``, ``prompt_token_ids``, ``token_logprobs`` (the sampled tokens' logprobs,
always returned) and ``token_versions`` (the weight version that produced each token); the
response has ``weight_version`` (the newest of them). ``text`` is always the tokenizer's decode of
``token_ids`` (special tokens skipped unless ``skip_special_tokens: false``), so streamed text
concatenates to the batch text. A request with ``return_routed_experts: true`` (SGLang's name;
vLLM's OpenAI server has no such field) gets ``routed_experts`` on each choice: nested lists
``[len(prompt_token_ids) + len(token_ids)][layers][top_k]``, row ``i`` the experts of position
``i`` of prompt plus completion, -1 where there is no route (always the last token's row).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.structured import StructuredOutput
from rlinfer_core.types import MAX_TOP_LOGPROBS, Completion, CompletionDelta, GenerateRequest, SamplingParams
from rlinfer_server.chat_render import RenderedChat
from rlinfer_server.compat import refuse_unsupported
from rlinfer_server.constraints import structured_constraint
from rlinfer_server.schemas import ChatRequest, CompletionRequest, SamplingFields
from rlinfer_server.tool_choice import ToolPlan, answer

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256


class Tokens:
    """The model's HF tokenizer: text prompts, output text and per-token strings."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @classmethod
    def load(cls, path: str) -> Tokens:
        """Load the tokenizer from a model directory (imports transformers)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer itself (chat templates)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (with the model's special tokens unless told, as vLLM does)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of output tokens (special tokens skipped unless told)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def piece(self, token_id: int) -> str:
        """The text of one token."""
        return str(self._tok.decode([token_id]))

    def strings(self, ids: Sequence[int]) -> list[str]:
        """The tokenizer's own string of each token (``/tokenize``'s ``token_strs``)."""
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(ids))]


def token_name(tokens: Tokens, token_id: int, as_id: bool) -> str:
    """How a logprob entry names a token: its text, or ``"token_id:N"`` (vLLM's
    ``return_tokens_as_token_ids``)."""
    return f"token_id:{token_id}" if as_id else tokens.piece(token_id)


def _prompt_logprobs(body: SamplingFields) -> dict[str, Any]:
    """SamplingParams fields of vLLM's ``prompt_logprobs`` (k: each prompt token's own logprob and
    its top k alternatives)."""
    if body.prompt_logprobs is None:
        return {}
    if body.stream:
        raise InvalidRequest("prompt_logprobs", "not available when streaming")
    if not 0 <= body.prompt_logprobs <= MAX_TOP_LOGPROBS:  # vLLM's -1 (the whole vocabulary) is not served
        raise InvalidRequest("prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {body.prompt_logprobs}")
    return {"prompt_logprobs": True, "prompt_top_logprobs": body.prompt_logprobs}


def _routed_experts(body: SamplingFields) -> bool:
    if body.return_routed_experts and body.stream:
        raise InvalidRequest("return_routed_experts", "routes come with batch answers, not when streaming")
    return body.return_routed_experts


def token_bias(bias: dict[str, float] | None, field: str) -> list[tuple[int, float]]:
    """A JSON ``logit_bias`` (token ids as string keys) as (token id, bias) pairs."""
    pairs: list[tuple[int, float]] = []
    for key, value in (bias or {}).items():
        try:
            pairs.append((int(key), value))
        except ValueError:
            raise InvalidRequest(field, f"keys must be token ids, got {key!r}") from None
    return pairs


def top_k_off_as_minus_one(top_k: int) -> int:
    """vLLM's ``top_k`` as rlinfer's: vLLM's server takes 0 or -1 for "off" (TRL sends 0), rlinfer -1."""
    return -1 if top_k == 0 else top_k


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """A ``stop`` field (one string, a list, or none) as a list."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def _sampling(
    body: SamplingFields, max_tokens: int, logprobs: int, structured: StructuredOutput | None = None
) -> SamplingParams:
    refuse_unsupported(body)
    bias = token_bias(body.logit_bias, "logit_bias")
    stop = stop_strings(body.stop)
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=top_k_off_as_minus_one(body.top_k),
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        n=body.n,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        stop=tuple(stop),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(bias),
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        logprobs_mode=body.logprobs_mode,
        **_prompt_logprobs(body),
        structured=structured,
        return_routed_experts=_routed_experts(body),
    )


def _ids(base: str | None, count: int) -> list[str]:
    root = base or uuid.uuid4().hex
    return [root] if count == 1 else [f"{root}-{i}" for i in range(count)]


def completion_requests(body: CompletionRequest, tokens: Tokens) -> list[GenerateRequest]:
    """One GenerateRequest per prompt of a ``/v1/completions`` body."""
    if body.echo:
        raise InvalidRequest("echo", "echo is not supported (the prompt's token ids are in prompt_token_ids)")
    if body.suffix is not None:
        raise InvalidRequest("suffix", "suffix is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest("best_of", f"must equal n ({body.n}) or be left out, got {body.best_of}")
    prompt = body.prompt
    special = body.add_special_tokens
    if isinstance(prompt, str):
        prompts = [tokens.encode(prompt, special)]
    elif not prompt:
        raise InvalidRequest("prompt", "must not be empty")
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    elif isinstance(prompt[0], str):
        prompts = [tokens.encode(p, special) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    if body.stream and len(prompts) != 1:
        raise InvalidRequest("prompt", "streaming takes exactly one prompt")
    logprobs = body.logprobs or 0
    structured = structured_constraint(body.response_format, body.structured_outputs)
    sampling = _sampling(body, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs, structured)
    return [
        GenerateRequest(prompt_token_ids=p, sampling=sampling, request_id=rid, priority=body.priority)
        for p, rid in zip(prompts, _ids(body.request_id, len(prompts)), strict=True)
    ]


def chat_request(body: ChatRequest, prompt: RenderedChat, plan: ToolPlan) -> GenerateRequest:
    """The GenerateRequest of a ``/v1/chat/completions`` body, over the prompt the server rendered
    (``plan`` adds the tool parser of ``auto`` or the constraint of ``required`` / named)."""
    if body.top_logprobs is not None and body.top_logprobs != 0 and not body.logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidRequest("max_completion_tokens", "give max_completion_tokens or max_tokens, not both")
    structured = structured_constraint(body.response_format, body.structured_outputs)
    if plan.constraint is not None:
        if structured is not None:
            field = "response_format" if body.response_format is not None else "structured_outputs"
            raise InvalidRequest(
                field, f"cannot be combined with tool_choice {plan.mode.value!r}, which constrains the output"
            )
        structured = plan.constraint
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    sampling = _sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else 0, structured)
    return GenerateRequest(
        prompt_token_ids=prompt.token_ids,
        images=prompt.images,
        sampling=sampling,
        request_id=_ids(body.request_id, 1)[0],
        tools=plan.specs if plan.parser is not None else None,
        tool_parser=plan.parser,
        priority=body.priority,
    )


def _extras(c: Completion | CompletionDelta) -> dict[str, Any]:
    return {
        "token_ids": list(c.token_ids),
        "token_logprobs": list(c.logprobs),
        "token_versions": list(c.token_versions or ()),
    }


def _routes(c: Completion) -> dict[str, Any]:
    """``routed_experts`` of a choice whose request asked: ``[tokens][layers][top_k]`` over prompt
    plus completion (:mod:`rlinfer_core.routing`'s alignment, -1 for a position without a route)."""
    return {} if c.routed_experts is None else {"routed_experts": c.routed_experts.tolist()}


def _completion_logprobs(
    c: Completion | CompletionDelta, top: Any, tokens: Tokens, offset: int, as_ids: bool
) -> dict[str, Any]:
    pieces = [tokens.piece(t) for t in c.token_ids]
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    names = [token_name(tokens, t, as_ids) for t in c.token_ids] if as_ids else pieces
    out: dict[str, Any] = {"tokens": names, "token_logprobs": list(c.logprobs), "text_offset": offsets}
    # as vLLM: each position's sampled token first, then its top alternatives (logprobs=0: the sampled one)
    steps = [{t: lp, **alt} for t, lp, alt in zip(c.token_ids, c.logprobs, top or [{}] * len(c.token_ids), strict=True)]
    out["top_logprobs"] = [{token_name(tokens, t, as_ids): lp for t, lp in step.items()} for step in steps]
    out["top_logprobs_ids"] = [{str(t): lp for t, lp in step.items()} for step in steps]
    return out


def _chat_entry(tokens: Tokens, token: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    name = token_name(tokens, token, as_ids)
    return {"token": name, "token_id": token, "logprob": logprob, "bytes": list(name.encode())}


def _chat_logprobs(c: Completion | CompletionDelta, top: Any, tokens: Tokens, as_ids: bool) -> dict[str, Any]:
    content = []
    for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        alts = top[i] if top else {}
        entry = _chat_entry(tokens, token, lp, as_ids)
        entry["top_logprobs"] = [_chat_entry(tokens, t, v, as_ids) for t, v in alts.items()]
        content.append(entry)
    return {"content": content}


def prompt_logprobs(c: Completion, tokens: Tokens, as_ids: bool) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` of the token itself and of its top k
    alternatives (rank 1..k). Ranks past the alternatives are not computed by the engines: a token
    outside them gets k + 1, a lower bound (with no alternatives asked for: null)."""
    if c.prompt_logprobs is None:
        return None
    tops = c.prompt_top_logprobs or (None,) * len(c.prompt_token_ids)
    out: list[dict[str, Any] | None] = []
    for token, lp, top in zip(c.prompt_token_ids, c.prompt_logprobs, tops, strict=False):
        if lp is None:
            out.append(None)
            continue
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
        rank_of = {t: i + 1 for i, (t, _) in enumerate(ranked)}
        own_rank = rank_of.get(token, len(ranked) + 1) if top is not None else None
        row = {str(token): {"logprob": lp, "rank": own_rank, "decoded_token": token_name(tokens, token, as_ids)}}
        for t, alt in ranked:
            row.setdefault(str(t), {"logprob": alt, "rank": rank_of[t], "decoded_token": token_name(tokens, t, as_ids)})
        out.append(row)
    return out


def usage(completions: Sequence[Completion]) -> dict[str, int]:
    """OpenAI usage: each request's prompt counted once, every sample's tokens."""
    prompts = {c.request_id: len(c.prompt_token_ids) for c in completions}
    generated = sum(len(c.token_ids) for c in completions)
    prompt = sum(prompts.values())
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def completion_response(
    body: CompletionRequest, requests: Sequence[GenerateRequest], completions: Sequence[Completion], tokens: Tokens
) -> dict[str, Any]:
    """The ``text_completion`` object (choice index = prompt index * n + sample index)."""
    order = {r.request_id: i for i, r in enumerate(requests)}
    as_ids = bool(body.return_tokens_as_token_ids)
    choices = []
    for c in completions:
        text = tokens.decode(c.token_ids, body.skip_special_tokens)
        logprobs = _completion_logprobs(c, c.top_logprobs, tokens, 0, as_ids) if body.logprobs is not None else None
        choice: dict[str, Any] = {
            "index": order[c.request_id] * body.n + c.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason.value,
            "stop_reason": c.stop_reason,
            "prompt_token_ids": list(c.prompt_token_ids),
            "prompt_logprobs": prompt_logprobs(c, tokens, as_ids),
            **_extras(c),
            **_routes(c),
        }
        choices.append(choice)
    choices.sort(key=lambda ch: ch["index"])
    return {
        "id": requests[0].request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": usage(completions),
        "weight_version": max((c.weight_version for c in completions), default=0),
    }


def chat_choice_text(body: ChatRequest, token_ids: Sequence[int], tokens: Tokens) -> str:
    """The content text of a chat output (the decode of its tokens)."""
    return tokens.decode(token_ids, body.skip_special_tokens)


def chat_response(
    body: ChatRequest, prompt: RenderedChat, plan: ToolPlan, completions: Sequence[Completion], tokens: Tokens
) -> dict[str, Any]:
    """The ``chat.completion`` object; with tools, each message is read as
    :func:`rlinfer_server.tool_choice.answer` says."""
    as_ids = bool(body.return_tokens_as_token_ids)
    choices = []
    ordered = sorted(completions, key=lambda c: c.index)
    for c in ordered:
        said = answer(plan, chat_choice_text(body, c.token_ids, tokens), c.finish_reason.value, c.tool_calls)
        choice: dict[str, Any] = {
            "index": c.index,
            "message": said.message(),
            "logprobs": _chat_logprobs(c, c.top_logprobs, tokens, as_ids) if body.logprobs else None,
            "finish_reason": said.finish_reason,
            "stop_reason": c.stop_reason,
            "prompt_token_ids": list(c.prompt_token_ids),
            **_extras(c),
            **_routes(c),
        }
        if said.errors:
            choice["tool_call_errors"] = [dict(e) for e in said.errors]
        choices.append(choice)
    out: dict[str, Any] = {
        "id": completions[0].request_id if completions else "",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": usage(completions),
        "prompt_token_ids": list(prompt.token_ids),
        "prompt_logprobs": prompt_logprobs(ordered[0], tokens, as_ids) if ordered else None,
        "weight_version": max((c.weight_version for c in completions), default=0),
    }
    if body.return_prompt_text:
        out["prompt_text"] = prompt.text
    return out


class Detokenizer:
    """Incremental text of streamed tokens, per sample: holds back an unfinished UTF-8 sequence."""

    def __init__(self, tokens: Tokens, skip_special_tokens: bool = True) -> None:
        self._tokens = tokens
        self._skip = skip_special_tokens
        self._ids: dict[int, list[int]] = {}
        self._sent: dict[int, str] = {}

    def token_ids(self, index: int) -> list[int]:
        """Every token of sample ``index`` pushed so far."""
        return list(self._ids.get(index, ()))

    def offset(self, index: int) -> int:
        """Characters of sample ``index`` sent so far."""
        return len(self._sent.get(index, ""))

    def push(self, index: int, ids: Sequence[int], final: bool) -> str:
        """Add ``ids`` to sample ``index``; return the new text."""
        all_ids = self._ids.setdefault(index, [])
        all_ids.extend(ids)
        text = self._tokens.decode(all_ids, self._skip)
        if text.endswith("\ufffd") and not final:
            return ""
        sent = self._sent.get(index, "")
        new = text[len(sent) :] if text.startswith(sent) else text
        self._sent[index] = text
        return new


def completion_chunk(
    body: CompletionRequest, delta: CompletionDelta, text: str, offset: int, tokens: Tokens
) -> dict[str, Any]:
    """One ``text_completion`` stream chunk."""
    as_ids = bool(body.return_tokens_as_token_ids)
    return {
        "id": delta.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": delta.index,
                "text": text,
                "logprobs": _completion_logprobs(delta, None, tokens, offset, as_ids)
                if body.logprobs is not None
                else None,
                "finish_reason": delta.finish_reason.value if delta.finish_reason else None,
                "stop_reason": delta.stop_reason,
                **_extras(delta),
            }
        ],
        "weight_version": delta.weight_version,
    }


def chat_chunk(
    body: ChatRequest,
    delta: CompletionDelta,
    message: dict[str, Any],
    finish_reason: str | None,
    tokens: Tokens,
    prompt: RenderedChat | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` carrying ``message`` as its delta; the first chunk has the
    response-level ``prompt_token_ids`` (and ``prompt_text`` when asked), as vLLM's."""
    chunk: dict[str, Any] = {
        "id": delta.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": delta.index,
                "delta": message,
                "logprobs": _chat_logprobs(delta, None, tokens, bool(body.return_tokens_as_token_ids))
                if body.logprobs
                else None,
                "finish_reason": finish_reason,
                "stop_reason": delta.stop_reason,
                **_extras(delta),
            }
        ],
        "weight_version": delta.weight_version,
    }
    if prompt is not None:
        chunk["prompt_token_ids"] = list(prompt.token_ids)
        if body.return_prompt_text:
            chunk["prompt_text"] = prompt.text
    return chunk
