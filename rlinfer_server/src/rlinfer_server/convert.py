"""OpenAI request bodies -> rlinfer GenerateRequests, and Completions -> OpenAI responses.

Extensions on every choice (ignored by OpenAI clients, in ``choice.model_extra`` of the ``openai``
package): ``token_ids``, ``prompt_token_ids``, ``token_logprobs`` (the sampled tokens' logprobs,
always returned) and ``token_versions`` (the weight version that produced each token); the
response has ``weight_version`` (the newest of them). ``text`` is always the tokenizer's decode of
``token_ids`` (special tokens skipped), so streamed text concatenates to the batch text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import ChatMessage, Completion, CompletionDelta, GenerateRequest, SamplingParams
from rlinfer_server.schemas import ChatRequest, CompletionRequest, SamplingFields

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

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt (with the model's special tokens, as vLLM does)."""
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of output tokens (special tokens skipped)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def piece(self, token_id: int) -> str:
        """The text of one token."""
        return str(self._tok.decode([token_id]))


def _sampling(body: SamplingFields, max_tokens: int, logprobs: int) -> SamplingParams:
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        try:
            bias.append((int(key), value))
        except ValueError:
            raise InvalidRequest("logit_bias", f"keys must be token ids, got {key!r}") from None
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
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
    if isinstance(prompt, str):
        prompts = [tokens.encode(prompt)]
    elif not prompt:
        raise InvalidRequest("prompt", "must not be empty")
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    elif isinstance(prompt[0], str):
        prompts = [tokens.encode(p) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    if body.stream and len(prompts) != 1:
        raise InvalidRequest("prompt", "streaming takes exactly one prompt")
    logprobs = body.logprobs or 0
    sampling = _sampling(body, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs)
    return [
        GenerateRequest(prompt_token_ids=p, sampling=sampling, request_id=rid)
        for p, rid in zip(prompts, _ids(body.request_id, len(prompts)), strict=True)
    ]


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_request(body: ChatRequest) -> GenerateRequest:
    """The GenerateRequest of a ``/v1/chat/completions`` body (the engine applies the template)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidRequest("max_completion_tokens", "give max_completion_tokens or max_tokens, not both")
    messages = [
        ChatMessage(
            role=m.role, content=m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        )
        for m in body.messages
    ]
    if not messages:
        raise InvalidRequest("messages", "must hold at least one message")
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    sampling = _sampling(body, max_tokens, body.top_logprobs or 0)
    return GenerateRequest(messages=messages, sampling=sampling, request_id=_ids(body.request_id, 1)[0])


def _extras(c: Completion | CompletionDelta) -> dict[str, Any]:
    return {
        "token_ids": list(c.token_ids),
        "token_logprobs": list(c.logprobs),
        "token_versions": list(c.token_versions or ()),
    }


def _completion_logprobs(c: Completion | CompletionDelta, top: Any, tokens: Tokens, offset: int) -> dict[str, Any]:
    pieces = [tokens.piece(t) for t in c.token_ids]
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    out: dict[str, Any] = {"tokens": pieces, "token_logprobs": list(c.logprobs), "text_offset": offsets}
    out["top_logprobs"] = [{tokens.piece(t): lp for t, lp in alt.items()} for alt in top] if top else None
    out["top_logprobs_ids"] = [{str(t): lp for t, lp in alt.items()} for alt in top] if top else None
    return out


def _chat_logprobs(c: Completion | CompletionDelta, top: Any, tokens: Tokens) -> dict[str, Any]:
    content = []
    for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        piece = tokens.piece(token)
        alts = top[i] if top else {}
        content.append(
            {
                "token": piece,
                "token_id": token,
                "logprob": lp,
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {"token": tokens.piece(t), "token_id": t, "logprob": v, "bytes": list(tokens.piece(t).encode())}
                    for t, v in alts.items()
                ],
            }
        )
    return {"content": content}


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
    choices = []
    for c in completions:
        text = tokens.decode(c.token_ids)
        choice: dict[str, Any] = {
            "index": order[c.request_id] * body.n + c.index,
            "text": text,
            "logprobs": _completion_logprobs(c, c.top_logprobs, tokens, 0) if body.logprobs is not None else None,
            "finish_reason": c.finish_reason.value,
            "stop_reason": c.stop_reason,
            "prompt_token_ids": list(c.prompt_token_ids),
            **_extras(c),
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


def chat_response(body: ChatRequest, completions: Sequence[Completion], tokens: Tokens) -> dict[str, Any]:
    """The ``chat.completion`` object."""
    choices = []
    for c in sorted(completions, key=lambda c: c.index):
        text = tokens.decode(c.token_ids)
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": text},
                "logprobs": _chat_logprobs(c, c.top_logprobs, tokens) if body.logprobs else None,
                "finish_reason": c.finish_reason.value,
                "stop_reason": c.stop_reason,
                "prompt_token_ids": list(c.prompt_token_ids),
                **_extras(c),
            }
        )
    return {
        "id": completions[0].request_id if completions else "",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": usage(completions),
        "weight_version": max((c.weight_version for c in completions), default=0),
    }


class Detokenizer:
    """Incremental text of streamed tokens, per sample: holds back an unfinished UTF-8 sequence."""

    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens
        self._ids: dict[int, list[int]] = {}
        self._sent: dict[int, str] = {}

    def offset(self, index: int) -> int:
        """Characters of sample ``index`` sent so far."""
        return len(self._sent.get(index, ""))

    def push(self, index: int, ids: Sequence[int], final: bool) -> str:
        """Add ``ids`` to sample ``index``; return the new text."""
        all_ids = self._ids.setdefault(index, [])
        all_ids.extend(ids)
        text = self._tokens.decode(all_ids)
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
    return {
        "id": delta.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": delta.index,
                "text": text,
                "logprobs": _completion_logprobs(delta, None, tokens, offset) if body.logprobs is not None else None,
                "finish_reason": delta.finish_reason.value if delta.finish_reason else None,
                "stop_reason": delta.stop_reason,
                **_extras(delta),
            }
        ],
        "weight_version": delta.weight_version,
    }


def chat_chunk(body: ChatRequest, delta: CompletionDelta, text: str, first: bool, tokens: Tokens) -> dict[str, Any]:
    """One ``chat.completion.chunk``."""
    message: dict[str, Any] = {"content": text}
    if first:
        message["role"] = "assistant"
    return {
        "id": delta.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": delta.index,
                "delta": message,
                "logprobs": _chat_logprobs(delta, None, tokens) if body.logprobs else None,
                "finish_reason": delta.finish_reason.value if delta.finish_reason else None,
                "stop_reason": delta.stop_reason,
                **_extras(delta),
            }
        ],
        "weight_version": delta.weight_version,
    }
