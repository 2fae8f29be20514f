"""rlinfer's logits processor, run by SGLang's sampler inside the scheduler (one per batch).

SGLang's own repetition penalty counts generated tokens only, while rlinfer's contract counts
prompt and generated tokens; so rlinfer applies the whole pre-temperature pipeline itself, in the
contract's order, from the request's own token ids (``custom_params["__req__"]``, which SGLang
hands custom processors):

    repetition penalty (prompt + generated) -> presence/frequency (generated) -> logit_bias
    -> allowed_token_ids mask

SGLang then divides by the temperature and truncates (top_k, top_p, min_p) as usual. The class
derives from SGLang's ``DisallowedTokensLogitsProcessor`` only so that SGLang accepts it together
with ``return_sampling_mask`` (which rlinfer uses for logprobs renormalised after truncation):
that check exists for SGLang's mask replay, which rlinfer does not use; the sampler computes the
returned behaviour logprob from the probabilities it sampled from, after this processor ran.

This module imports SGLang at import time: only the backend (lazily) and the scheduler load it.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

#: keys of the per-request ``custom_params`` this processor reads
KEYS = ("rlinfer_rep", "rlinfer_presence", "rlinfer_frequency", "rlinfer_bias_ids", "rlinfer_bias", "rlinfer_allowed")


class RLInferLogitsProcessor(DisallowedTokensLogitsProcessor):  # type: ignore[misc]
    """Penalties, logit bias and allowed tokens with rlinfer's semantics (see the module doc)."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """Process every row that carries rlinfer parameters, in place."""
        for row, params in enumerate(custom_param_list or ()):
            if params:
                _process_row(logits, row, params)
        return logits


def _process_row(logits: torch.Tensor, row: int, params: dict[str, Any]) -> None:
    req = params.get("__req__")
    values = logits[row]
    generated = list(req.output_ids) if req is not None else []
    rep = float(params.get("rlinfer_rep", 1.0))
    if rep != 1.0 and req is not None:
        seen = torch.tensor(sorted(set(req.origin_input_ids) | set(generated)), dtype=torch.long, device=logits.device)
        picked = values[seen]
        values[seen] = torch.where(picked > 0, picked / rep, picked * rep)
    presence = float(params.get("rlinfer_presence", 0.0))
    frequency = float(params.get("rlinfer_frequency", 0.0))
    if generated and (presence or frequency):
        ids = torch.tensor(generated, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=values.numel())[: values.numel()].to(values.dtype)
        values -= presence * (counts > 0).to(values.dtype) + frequency * counts
    bias_ids = params.get("rlinfer_bias_ids")
    if bias_ids:
        ids = torch.tensor(bias_ids, dtype=torch.long, device=logits.device)
        values[ids] += torch.tensor(params["rlinfer_bias"], dtype=values.dtype, device=logits.device)
    allowed = params.get("rlinfer_allowed")
    if allowed is not None:
        keep = torch.zeros_like(values, dtype=torch.bool)
        keep[torch.tensor(allowed, dtype=torch.long, device=logits.device)] = True
        values.masked_fill_(~keep, float("-inf"))


def serialized() -> str:
    """The processor as SGLang's ``custom_logit_processor`` string."""
    return str(RLInferLogitsProcessor.to_str())
