"""Trainer side: a transformers causal LM in float32 on CPU, and the GRPO math.

The pure functions (:func:`group_advantages`, :func:`grpo_loss`, :func:`token_logprobs`) work
on plain tensors so they are unit-tested without a model or an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (+eps).

    ``rewards`` is flat, groups are consecutive runs of ``group_size``. A group whose rewards are
    all equal gets zero advantages (no signal), never NaN.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of {group_size} items, got {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    return ((grouped - mean) / (std + eps)).view(-1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> torch.Tensor:
    """Clipped policy-gradient (PPO/GRPO) loss, averaged over the valid tokens.

    Shapes: ``logprobs``/``old_logprobs``/``mask`` are [batch, tokens], ``advantages`` [batch].
    On-policy (logprobs == old_logprobs) the value is ``-mean(advantage)`` over tokens and the
    gradient is the REINFORCE gradient with those advantages.
    """
    ratio = (logprobs - old_logprobs).exp()
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -(unclipped.minimum(clipped))
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[target] per position, in float32 (temperature 1)."""
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class Policy:
    """A HF causal LM held in float32 on CPU, with teacher-forced logprobs and a GRPO step."""

    def __init__(self, model_dir: str | Path, lr: float = 3e-3, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.pad_id = 0

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """HF-named parameters (detached), as the engine's weight update expects them."""
        return [(name, p.detach()) for name, p in self.model.named_parameters()]

    def _batch(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], int]:
        import torch

        rows = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # right padding keeps positions 0..len-1 as in the engine
            ids[i, : len(r)] = torch.tensor(r)
            attn[i, : len(r)] = 1
        max_c = max((len(c) for c in completions), default=0)
        mask = torch.zeros((len(rows), max_c))
        for i, c in enumerate(completions):
            mask[i, : len(c)] = 1.0
        return ids, attn, mask, [len(p) for p in prompts], max_c

    def completion_logprobs(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced logprobs of each completion token: ([batch, max_len], mask), with grad."""
        import torch

        ids, attn, mask, prompt_lens, max_c = self._batch(prompts, completions)
        logits = self.model(input_ids=ids, attention_mask=attn).logits
        out = torch.zeros((ids.shape[0], max_c))
        rows = []
        for i, (plen, comp) in enumerate(zip(prompt_lens, completions, strict=True)):
            n = len(comp)
            if n == 0:
                rows.append(out[i])
                continue
            lp = token_logprobs(logits[i, plen - 1 : plen - 1 + n], ids[i, plen : plen + n])
            rows.append(torch.cat([lp, out[i, n:]]))
        return torch.stack(rows), mask

    def train_step(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
    ) -> float:
        """One optimizer step on the GRPO loss; returns the loss value."""
        import torch

        logprobs, mask = self.completion_logprobs(prompts, completions)
        loss = grpo_loss(logprobs, old_logprobs, advantages, mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return float(loss.detach())
