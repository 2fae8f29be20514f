"""The reference: a Hugging Face transformers forward pass on the same weights (float32).

A completion is checked by teacher forcing: one forward pass over ``prompt + tokens`` gives,
for every generated position, the logits the engine should have sampled from. Greedy tokens
must be the argmax (up to exact ties), and each token's logprob must equal
``log_softmax(logits / T)`` of that token (plain ``log_softmax`` when greedy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from rlinfer_core.multimodal import Image
    from rlinfer_core.types import Completion, GenerateRequest

#: logits closer than this count as a tie for the argmax check (at the CPU logprob tolerance)
TIE_TOLERANCE = 1e-4


def tie_band(logprob_tolerance: float) -> float:
    """The argmax tie band for a logprob tolerance ``tol`` (``--rlinfer-logprob-tol``, e.g. for
    GPU kernels): an engine whose logits may be off by ``tol`` may swap two logits closer than
    2 * tol."""
    return max(TIE_TOLERANCE, 2 * logprob_tolerance)


@attrs.frozen
class Parity:
    """Result of checking completions against the oracle."""

    max_abs_logprob_delta: float  #: max |engine logprob - oracle logprob| over checked tokens
    tokens_checked: int
    argmax_mismatches: tuple[str, ...]  #: one line per greedy token that is not the argmax

    def merge(self, other: Parity) -> Parity:
        """Combine two results."""
        return Parity(
            max(self.max_abs_logprob_delta, other.max_abs_logprob_delta),
            self.tokens_checked + other.tokens_checked,
            self.argmax_mismatches + other.argmax_mismatches,
        )


EMPTY = Parity(0.0, 0, ())


class Oracle:
    """HF transformers models (float32, eval mode) keyed by name, e.g. "seed0", "seed1".

    ``weight_dtype``: the dtype :meth:`named_parameters` hands out (what the engine under test
    serves, e.g. "bfloat16" where an engine's GPU kernels lack float32); the reference logits
    are always float32. ``tie_tolerance``: logits closer than this count as a tie (:func:`tie_band`).
    """

    def __init__(self, weight_dtype: str = "float32", tie_tolerance: float = TIE_TOLERANCE) -> None:
        self.weight_dtype = weight_dtype
        self.tie_tolerance = tie_tolerance
        self._models: dict[str, Any] = {}
        self._dirs: dict[str, Path] = {}
        self._tokenizer: Any = None
        self._processor: Any = None  #: a vision-language model's HF processor (images)
        self._names: dict[str, dict[str, str]] = {}  #: runtime -> checkpoint names where they differ

    def add(self, key: str, model_dir: str | Path) -> None:
        """Load the model in ``model_dir`` under ``key`` (a vision-language model with its HF
        processor, which turns images into the pixel inputs the engines' processors make too)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        vision = getattr(AutoConfig.from_pretrained(str(model_dir)), "vision_config", None) is not None
        loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = loader.from_pretrained(str(model_dir), dtype=torch.float32)
        model.eval()
        if vision and self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(str(model_dir))
        if vision:
            from rlinfer_core.multimodal import checkpoint_names

            self._names[key] = checkpoint_names(model_dir, [n for n, _ in model.named_parameters()])
        self._models[key] = model
        self._dirs[key] = Path(model_dir)
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def tied(self, key: str) -> dict[str, str]:
        """``{"lm_head.weight": "model.embed_tokens.weight"}`` when model ``key`` ties them."""
        config = self._models[key].config
        tie = getattr(config, "tie_word_embeddings", False)
        return {"lm_head.weight": "model.embed_tokens.weight"} if tie else {}

    def model_dir(self, key: str) -> Path:
        """Directory the model ``key`` was loaded from."""
        return self._dirs[key]

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer shared by every model."""
        return self._tokenizer

    def named_parameters(self, key: str) -> list[tuple[str, torch.Tensor]]:
        """HF checkpoint names and detached copies of model ``key``'s tensors, in ``weight_dtype``."""
        import torch

        # "auto": the engine serves the checkpoint's dtypes, i.e. the oracle's own float32
        dtype = torch.float32 if self.weight_dtype == "auto" else getattr(torch, self.weight_dtype)
        names = self._names.get(key, {})
        return [
            (names.get(n, n), p.detach().to(dtype=dtype, copy=True)) for n, p in self._models[key].named_parameters()
        ]

    @property
    def processor(self) -> Any:
        """The HF processor of a vision-language model (None for text models)."""
        return self._processor

    def image_inputs(self, token_ids: Sequence[int], images: Sequence[Image]) -> dict[str, Any]:
        """The model's keyword inputs for ``images`` beside ``token_ids`` (placeholders already
        expanded): the processor's pixel values and grid, and M-RoPE's image-token mask."""
        import torch

        if not images:
            return {}
        pixels = self._processor.image_processor(images=[image.to_pil() for image in images], return_tensors="pt")
        image_token = self._processor.tokenizer.convert_tokens_to_ids(self._processor.image_token)
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        return {**pixels, "mm_token_type_ids": (ids == image_token).long()}

    def logits(self, key: str, token_ids: Sequence[int], images: Sequence[Image] = ()) -> torch.Tensor:
        """Logits (float32, [len, vocab]) of model ``key`` over ``token_ids`` (with ``images`` for
        a vision-language model: ``token_ids`` hold their expanded placeholders)."""
        import torch

        with torch.inference_mode():
            inputs = self.image_inputs(token_ids, images)
            out = self._models[key](torch.tensor([list(token_ids)], dtype=torch.long), **inputs)
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def hidden_states(self, key: str, token_ids: Sequence[int]) -> torch.Tensor:
        """Final-layer hidden states (float32, [len, hidden]) of model ``key`` over ``token_ids``:
        the base model's ``last_hidden_state``, after the final norm (the LM head's input)."""
        import torch

        model = self._models[key]
        with torch.inference_mode():
            out = model.base_model(torch.tensor([list(token_ids)], dtype=torch.long))
        states: torch.Tensor = out.last_hidden_state[0].float()
        return states

    def greedy(self, key: str, prompt: Sequence[int], max_tokens: int, eos: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of ``prompt`` (stops after an ``eos`` token)."""
        ids = list(prompt)
        out: list[int] = []
        for _ in range(max_tokens):
            token = int(self.logits(key, ids)[-1].argmax())
            out.append(token)
            ids.append(token)
            if token in eos:
                break
        return out

    def check(self, key: str, request: GenerateRequest, completion: Completion) -> Parity:
        """Teacher-force ``completion`` through model ``key`` and compare tokens and logprobs.

        Greedy tokens are checked against the argmax of the processed logits; logprobs against
        the request's logprobs mode (:mod:`rlinfer_conformance.processing`).
        """
        tokens = list(completion.token_ids)
        if not tokens:
            return EMPTY
        prompt = list(completion.prompt_token_ids)
        logits = self.logits(key, prompt + tokens, request.all_images)
        return self._compare(request, completion, prompt, logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)])

    def check_versions(self, keys: Mapping[int, str], request: GenerateRequest, completion: Completion) -> Parity:
        """Check a greedy completion whose tokens came from two weight versions (an update while
        it was in flight): each token against the model of its own version.

        After the switch at token ``k`` the engine attends to KV computed by the old weights for
        the prompt and tokens before ``k - 1`` (unless it recomputed them); both readings are
        tried and the closer one is returned.
        """
        import torch

        versions = list(completion.token_versions or ())
        tokens = list(completion.token_ids)
        prompt = list(completion.prompt_token_ids)
        assert len(versions) == len(tokens), "one version per token"
        switch = next((i for i, v in enumerate(versions) if v != versions[0]), len(tokens))
        assert all(v == versions[-1] for v in versions[switch:]), f"one switch at most: {versions}"
        old, new = keys[versions[0]], keys[versions[-1]]
        full_old = self.logits(old, prompt + tokens)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        if switch == len(tokens):
            return self._compare(request, completion, prompt, full_old)
        full_new = self.logits(new, prompt + tokens)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        recomputed = torch.cat([full_old[:switch], full_new[switch:]])
        mixed = torch.cat([full_old[:switch], self._logits_on_cache(old, new, prompt, tokens, switch)])
        a = self._compare(request, completion, prompt, mixed)
        b = self._compare(request, completion, prompt, recomputed)
        return min(a, b, key=lambda p: (len(p.argmax_mismatches), p.max_abs_logprob_delta))

    def _logits_on_cache(self, old: str, new: str, prompt: list[int], tokens: list[int], switch: int) -> torch.Tensor:
        """Logits of model ``new`` predicting ``tokens[switch:]`` over KV that model ``old``
        computed for ``prompt + tokens[:switch - 1]``."""
        import torch

        prefix = prompt + tokens[: switch - 1]
        with torch.inference_mode():
            cache = self._models[old](torch.tensor([prefix]), use_cache=True).past_key_values
            out = self._models[new](torch.tensor([tokens[switch - 1 : len(tokens) - 1]]), past_key_values=cache)
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def _compare(
        self, request: GenerateRequest, completion: Completion, prompt: list[int], logits: torch.Tensor
    ) -> Parity:
        import torch

        from rlinfer_conformance.processing import processed_logprobs

        tokens = list(completion.token_ids)
        s = request.sampling
        logprobs = processed_logprobs(logits, prompt, tokens, s)
        picked = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        engine = torch.tensor(completion.logprobs, dtype=torch.float64)
        delta = float((picked - engine).abs().max()) if len(engine) == len(tokens) else float("inf")
        mismatches = []
        tie = self.tie_tolerance
        if s.greedy:
            for i, token in enumerate(tokens):
                row = logprobs[i]
                best = int(row.argmax())
                gap = float(row[best] - row[token])
                if best != token and gap > tie:
                    mismatches.append(
                        f"{request.request_id}[{i}]: engine {token}, oracle argmax {best} (logprob gap {gap:.3g})"
                    )
        return Parity(delta, len(tokens), tuple(mismatches))

    def check_all(self, key: str, requests: Sequence[GenerateRequest], completions: Sequence[Completion]) -> Parity:
        """:meth:`check` every completion against the request with its ``request_id``."""
        by_id = {r.request_id: r for r in requests}
        result = EMPTY
        for completion in completions:
            result = result.merge(self.check(key, by_id[completion.request_id], completion))
        return result

    def prompt_logprobs(self, key: str, prompt: Sequence[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]) for i >= 1 (plain log_softmax)."""
        import torch

        logits = self.logits(key, prompt)
        lp = torch.log_softmax(logits.double(), dim=-1)
        return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]

    def prompt_top_logprobs(self, key: str, prompt: Sequence[int], k: int) -> list[dict[int, float]]:
        """The ``k`` most likely tokens and their logprobs at prompt positions 1.. (plain log_softmax)."""
        import torch

        lp = torch.log_softmax(self.logits(key, prompt)[: len(prompt) - 1].double(), dim=-1)
        values, ids = lp.topk(k, dim=-1)
        return [
            {int(i): float(v) for i, v in zip(ids[row], values[row], strict=True)} for row in range(len(prompt) - 1)
        ]

    def top_logprobs(self, key: str, prompt: Sequence[int], tokens: Sequence[int], k: int) -> list[dict[int, float]]:
        """The ``k`` most likely tokens and their logprobs at each generated position (greedy)."""
        import torch

        full = list(prompt) + list(tokens)
        logits = self.logits(key, full)[len(prompt) - 1 : len(full) - 1]
        lp = torch.log_softmax(logits.double(), dim=-1)
        values, ids = lp.topk(k, dim=-1)
        return [{int(i): float(v) for i, v in zip(ids[row], values[row], strict=True)} for row in range(len(tokens))]
