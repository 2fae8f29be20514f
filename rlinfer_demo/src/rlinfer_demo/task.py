"""The demo's task: prompts and a verifiable reward a tiny random model can learn fast.

Reward: the fraction of generated tokens that are digit tokens (their text, stripped, is all
digits). A random 384-token model emits them ~4% of the time; a few dozen GRPO steps make it
emit them most of the time. The reward is checked by string inspection only (verifiable).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

PROMPT_TEXTS: tuple[str, ...] = (
    "Numbers:",
    "Question: what is 2 + 3? Answer:",
    "The quick brown fox",
    "user: hello there. assistant:",
    "A rollout engine generates tokens;",
    "Reinforcement learning from verifiable rewards:",
    "Question: what is 7 + 8? Answer:",
    "abcdefghijklmnopqrstuvwxyz",
)


def is_digit_text(text: str) -> bool:
    """True when ``text`` (stripped of whitespace) is non-empty and all ASCII digits."""
    stripped = text.strip()
    return bool(stripped) and stripped.isascii() and stripped.isdigit()


def _prompt_tuples(prompts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(t) for t in p) for p in prompts)


def _id_set(ids: Iterable[int]) -> frozenset[int]:
    return frozenset(int(i) for i in ids)


@attrs.frozen
class DigitTask:
    """Prompts (token ids) and the set of token ids that count as digits."""

    prompts: tuple[tuple[int, ...], ...] = attrs.field(converter=_prompt_tuples)
    digit_token_ids: frozenset[int] = attrs.field(converter=_id_set)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, num_prompts: int = len(PROMPT_TEXTS)) -> DigitTask:
        """Build the task from a HF tokenizer: encode the prompts, find the digit tokens."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        texts = [PROMPT_TEXTS[i % len(PROMPT_TEXTS)] for i in range(num_prompts)]
        prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        vocab = len(tokenizer)
        digits = {i for i in range(vocab) if is_digit_text(tokenizer.decode([i]))}
        if not digits:
            raise ValueError("the tokenizer has no digit tokens; the demo's reward needs some")
        return cls(prompts, digits)

    def reward(self, token_ids: Sequence[int]) -> float:
        """Fraction of ``token_ids`` that are digit tokens (0.0 for an empty completion)."""
        if not token_ids:
            return 0.0
        return sum(1 for t in token_ids if t in self.digit_token_ids) / len(token_ids)
