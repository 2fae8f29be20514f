"""TEST DOUBLE ONLY: an rlinfer backend over plain HF transformers (no real engine).

It exists so the conformance kit can be tested inside the core tests without vLLM/SGLang. It is
registered only by tests/core/test_conformance_kit.py (through a temporary dist-info entry
point) and is never used for the vllm/sglang runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch

from rlinfer_core.discovery import BackendInfo
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.types import (
    Capabilities,
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    FinishReason,
    GenerateRequest,
)
from rlinfer_core.weights import Buckets, CheckpointDir, NamedTensors, TensorSpec, WeightUpdate

NAME = "hfdouble"
SUPPORTED = {
    Capability.STREAM,
    Capability.CHAT,
    Capability.MULTI_SAMPLE,
    Capability.SEEDED_SAMPLING,
    Capability.WEIGHTS_TENSORS,
    Capability.WEIGHTS_BUCKETS,
    Capability.WEIGHTS_DISK,
    Capability.PREFIX_CACHE_RESET,
    Capability.BENCH,
}


def describe() -> Capabilities:
    import transformers

    notes = {c.value: "not implemented by the HF test double" for c in Capability if c not in SUPPORTED}
    return Capabilities(NAME, transformers.__version__, "cpu", SUPPORTED, notes)


class HFDouble:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model: Any = None
        self.tokenizer: Any = None
        self._calls = 0

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        return describe()

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        cfg = self.model.config
        return ModelInfo(cfg.vocab_size, self.config.max_model_len or cfg.max_position_embeddings, (cfg.eos_token_id,))

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        return {
            n: TensorSpec(n, str(p.dtype).removeprefix("torch."), tuple(p.shape))
            for n, p in self.model.named_parameters()
        }

    def _prompt(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        ids = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in request.messages or ()],
            add_generation_prompt=True,
            tokenize=True,
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _samples(self, request: GenerateRequest, index: int) -> Any:
        s = request.sampling
        prompt = self._prompt(request)
        ids = list(prompt)
        gen = torch.Generator().manual_seed((s.seed if s.seed is not None else self.config.seed + self._calls) + index)
        self._calls += 1
        eos = self.rlinfer_model_info().eos_token_ids
        limit = self.rlinfer_model_info().max_model_len
        out: list[int] = []
        while True:
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0, -1].double()
            if len(out) < s.min_tokens:
                for t in {*s.stop_token_ids, *(() if s.ignore_eos else eos)}:
                    logits[t] = float("-inf")
            if s.greedy:
                token = int(logits.argmax())
                logprob = float(torch.log_softmax(logits, -1)[token])
            else:
                scaled = logits / s.temperature
                lp = torch.log_softmax(scaled, -1)
                probs = lp.exp()
                if s.top_k > 0:
                    kth = probs.topk(min(s.top_k, probs.numel())).values[-1]
                    probs = torch.where(probs < kth, 0.0, probs)
                if s.top_p < 1.0:
                    sorted_p, order = probs.sort(descending=True)
                    drop = sorted_p.cumsum(0) - sorted_p > s.top_p
                    probs[order[drop]] = 0.0
                token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
                logprob = float(lp[token])
            out.append(token)
            ids.append(token)
            finish, reason = None, None
            if token in s.stop_token_ids:
                finish, reason = FinishReason.STOP, token
            elif token in eos and not s.ignore_eos:
                finish = FinishReason.STOP
            elif len(out) >= s.max_tokens or len(ids) >= limit:
                finish = FinishReason.LENGTH
            yield prompt, token, logprob, finish, reason
            if finish is not None:
                return

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        completions = []
        for r in requests:
            for i in range(r.sampling.n):
                steps = list(self._samples(r, i))
                prompt, _, _, finish, reason = steps[-1]
                completions.append(
                    Completion(
                        request_id=r.request_id,
                        index=i,
                        prompt_token_ids=tuple(prompt),
                        token_ids=tuple(s[1] for s in steps),
                        logprobs=tuple(s[2] for s in steps),
                        finish_reason=finish,
                        stop_reason=reason,
                    )
                )
        return completions

    @hookimpl
    def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        async def deltas() -> AsyncIterator[CompletionDelta]:
            for _, token, logprob, finish, reason in self._samples(request, 0):
                yield CompletionDelta(request.request_id, 0, (token,), (logprob,), finish, reason)

        return deltas()

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in tensors:
                params[name].copy_(t)

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        src = update.source
        if isinstance(src, NamedTensors):
            self._load(list(src.tensors))
        elif isinstance(src, Buckets):
            from rlinfer_core.transfer.buckets import unpack_all

            self._load(unpack_all(src.buckets))
        elif isinstance(src, CheckpointDir):
            from rlinfer_core.transfer.disk import read_checked

            self._load(read_checked(src.path))

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        return None

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        return None

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
        self.model = None

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        return sum(len(c.token_ids) for c in await self.rlinfer_generate(requests))

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        from rlinfer_core.transfer.disk import read_tensors

        self._load(read_tensors(path))


def create(config: EngineConfig) -> HFDouble:
    return HFDouble(config)


backend = BackendInfo(
    name=NAME, engine_requirements=("transformers>=4.40",), factory="hf_double:create", describe=describe
)
