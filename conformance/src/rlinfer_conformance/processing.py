"""The oracle's sampling processors: the distribution a backend must report logprobs from.

Implements :class:`rlinfer_core.types.LogprobsMode` on reference logits, one generated position
at a time (penalties depend on the tokens generated so far):

* ``raw``: ``log_softmax(logits)``;
* ``processed``: allowed-token mask and logit bias, repetition penalty (prompt and generated
  tokens), presence/frequency penalties (generated tokens), temperature, min_p, top_k, top_p,
  then ``log_softmax`` over what survives. Greedy requests stop before temperature.

The kit checks each processor on its own, so the relative order of two of them never decides a
test; the order above is vLLM's, which SGLang's matches for every single processor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlinfer_core.types import LogprobsMode, SamplingParams

if TYPE_CHECKING:
    import torch


def processed_logprobs(
    logits: torch.Tensor, prompt: Sequence[int], tokens: Sequence[int], sampling: SamplingParams
) -> torch.Tensor:
    """Logprobs ``[len(tokens), vocab]`` (float64) for each generated position of ``tokens``."""
    import torch

    logits = logits.double()
    if sampling.logprobs_mode is LogprobsMode.RAW:
        return torch.log_softmax(logits, dim=-1)
    rows = [_process_row(logits[i].clone(), prompt, tokens[:i], sampling) for i in range(len(tokens))]
    return torch.stack(rows) if rows else logits[:0]


def _process_row(row: torch.Tensor, prompt: Sequence[int], generated: Sequence[int], s: SamplingParams) -> torch.Tensor:
    import torch

    if s.allowed_token_ids is not None:
        mask = torch.full_like(row, float("-inf"))
        mask[list(s.allowed_token_ids)] = 0.0
        row = row + mask
    for token, bias in s.logit_bias:
        row[token] += bias
    if s.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / s.repetition_penalty, values * s.repetition_penalty)
    if generated and (s.presence_penalty or s.frequency_penalty):
        for token, count in Counter(generated).items():
            row[token] -= s.presence_penalty + s.frequency_penalty * count
    if s.greedy:
        return torch.log_softmax(row, dim=-1)
    row = row / s.temperature
    if s.min_p > 0.0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < s.min_p * probs.max(), float("-inf"))
    if s.top_k > 0 and s.top_k < row.numel():
        kth = torch.topk(row, s.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if s.top_p < 1.0:
        ascending, order = torch.sort(row)
        cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - s.top_p
        drop[-1] = False  # the most likely token always survives
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.log_softmax(row, dim=-1)
