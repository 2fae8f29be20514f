"""The model's chat template, applied incrementally for sessions (:mod:`rlinfer_core.session`).

The Hugging Face tokenizer of the model directory renders whole conversations; a session needs
the *new* text each turn adds, tokenised on its own, so that the ids the model saw stay fixed.
:meth:`ChatTemplate.delta` returns that text when the template is incremental (rendering the
conversation with one more message extends the previous rendering) and reports when it is not
(a template that rewrites earlier turns, e.g. one that drops earlier reasoning).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core.errors import InvalidRequest, RLInferError

if TYPE_CHECKING:
    from rlinfer_core.multimodal import Image
    from rlinfer_core.types import GenerateRequest

Message = Mapping[str, Any]


class TemplateContinuityError(RLInferError):
    """The chat template does not render this conversation incrementally: the whole-conversation
    rendering does not extend what the session already holds. ``reason`` says where; open the
    session with ``strict=False`` to go on with the turn flagged ``exact=False``."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"the chat template is not incremental here: {reason}. The session's tokens cannot match the "
            "whole-conversation rendering; use strict=False to continue with the turn flagged exact=False"
        )


@attrs.frozen
class Delta:
    """New text to append. ``exact``: the whole-conversation rendering equals the previous
    rendering plus ``text``; otherwise ``text`` is the message rendered after the last one alone
    and ``note`` says what differed."""

    text: str
    exact: bool = True
    note: str | None = None


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer in ``path`` (cached per path)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@functools.lru_cache(maxsize=4)
def load_processor(path: str) -> Any:
    """The Hugging Face processor in ``path`` (a vision-language model's; cached per path)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def prompt_ids(tokenizer: Any, request: GenerateRequest, max_model_len: int) -> list[int]:
    """The prompt a backend sends for ``request``: its ``prompt_token_ids``, or its ``messages``
    (and ``tools``) rendered by the engine's tokenizer's chat template with the generation prompt,
    tokenised without adding special tokens (the template holds them). InvalidRequest("messages")
    when there is no tokenizer, the template fails, or the prompt is empty or too long."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    assert request.messages is not None
    if tokenizer is None:
        raise InvalidRequest("messages", "the engine has no tokenizer; send prompt_token_ids")
    try:
        text = tokenizer.apply_chat_template(
            [m.template_dict() for m in request.messages],
            tools=[t.to_openai() for t in request.tools] if request.tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as exc:
        raise InvalidRequest("messages", f"the chat template failed: {exc}") from exc
    ids = list(tokenizer.encode(str(text), add_special_tokens=False))
    if not ids:
        raise InvalidRequest("messages", "the chat template produced an empty prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            "messages", f"the templated prompt has {len(ids)} tokens, max_model_len is {max_model_len}"
        )
    return ids


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ChatTemplate:
    """The tokenizer's chat template with a fixed tool list."""

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RLInferError("the model's tokenizer has no chat_template; open the session with chat_template=False")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The template's text for ``messages``."""
        text: str = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` on its own (special-token markers in it become their ids)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode_with_images(self, text: str, images: Sequence[Image]) -> list[int]:
        """Token ids of ``text`` with its image placeholders expanded by the model's HF processor
        (one run per image, as the engine will serve them)."""
        processor = load_processor(self.tokenizer.name_or_path)
        try:
            out = processor(text=[text], images=[image.to_pil() for image in images], add_special_tokens=False)
        except Exception as exc:
            raise InvalidRequest("content", f"the model's processor failed on the images: {exc}") from exc
        return list(out["input_ids"][0])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens kept (what the template would render)."""
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        return text

    def delta(self, before: str, after: str, fallback: tuple[str, str] | None, what: str) -> Delta:
        """Text that turns rendering ``before`` into ``after``; when ``after`` does not extend
        ``before``, the text of ``fallback = (base, base_plus_new)`` renderings instead."""
        if after.startswith(before):
            return Delta(after[len(before) :])
        at = _common_prefix(before, after)
        note = (
            f"{what}: the whole-conversation rendering differs from the session's at character {at} "
            f"({before[at : at + 40]!r} became {after[at : at + 40]!r})"
        )
        if fallback is None or not fallback[1].startswith(fallback[0]):
            return Delta(after[at:], exact=False, note=note)
        return Delta(fallback[1][len(fallback[0]) :], exact=False, note=note)

    @functools.cached_property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token that closes an assistant turn (e.g. ``<|im_end|>``), when the template
        has one: generation stops there so the session continues exactly as the template does."""
        probe = "rlinferprobe"
        messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}]
        try:
            text = self.render(messages, add_generation_prompt=False)
        except Exception:  # a template that rejects the probe has no derivable end token
            return ()
        tail = text[text.rfind(probe) + len(probe) :]
        ids = self.encode(tail)
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        return (ids[0],) if ids and ids[0] in special else ()
