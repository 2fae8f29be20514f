"""One demo run: generate through rlinfer, score, check parity, GRPO step, sync weights."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlinfer_core.engine import Engine, open_engine
from rlinfer_core.types import Capability, Completion, EngineConfig, GenerateRequest, SamplingParams
from rlinfer_core.weights import NamedTensors

#: max |trainer - engine| logprob allowed in float32 (the conformance kit's tolerance)
PARITY_TOLERANCE_FP32 = 1e-5


@attrs.frozen
class DemoConfig:
    """Everything a run depends on. ``model`` is a local HF causal LM directory."""

    backend: str
    model: str
    out: str
    steps: int = 30
    num_prompts: int = 8
    group_size: int = 8  #: G samples per prompt
    max_tokens: int = 12
    lr: float = 3e-3
    seed: int = 0
    parity_tolerance: float = PARITY_TOLERANCE_FP32


@attrs.frozen
class StepRecord:
    """What one step measured (all times in seconds)."""

    step: int
    weight_version: int  #: version of the weights that generated this step's samples
    reward_mean: float
    reward_min: float
    reward_max: float
    logprob_gap_max: float  #: max |trainer - engine| logprob over every sampled token
    tokens: int
    generate_s: float
    train_s: float
    sync_s: float
    loss: float
    memory: str  #: "released+resumed" or why it was skipped


@attrs.frozen
class RunInfo:
    """Facts about the engine of a run, known once it started."""

    backend: str
    engine_version: str
    platform: str
    capabilities: dict[str, Any]
    memory_release: str
    engine_start_s: float


def engine_config(cfg: DemoConfig) -> EngineConfig:
    """The engine's config: float32 (so parity is exact up to kernel rounding), small budgets."""
    return EngineConfig(
        model=cfg.model,
        dtype="float32",
        seed=cfg.seed,
        max_model_len=256,
        max_num_seqs=max(cfg.num_prompts * cfg.group_size, 1),
        kv_cache_memory_bytes=256 << 20,
        enforce_eager=True,  # a tiny model gains nothing from graph compilation; start is faster
        request_timeout_s=300.0,
    )


def build_requests(
    prompts: Sequence[Sequence[int]], cfg: DemoConfig, multi_sample: bool, step: int
) -> list[GenerateRequest]:
    """G samples per prompt at temperature 1: one request with n=G, or G requests where the
    backend lacks Capability.MULTI_SAMPLE. Completions come back in prompt order."""
    out = []
    for i, prompt in enumerate(prompts):
        if multi_sample:
            sampling = SamplingParams(temperature=1.0, max_tokens=cfg.max_tokens, n=cfg.group_size)
            out.append(GenerateRequest(prompt_token_ids=prompt, sampling=sampling, request_id=f"s{step}-p{i}"))
        else:
            sampling = SamplingParams(temperature=1.0, max_tokens=cfg.max_tokens)
            out.extend(
                GenerateRequest(prompt_token_ids=prompt, sampling=sampling, request_id=f"s{step}-p{i}-g{g}")
                for g in range(cfg.group_size)
            )
    return out


def logprob_gap(engine_logprobs: Sequence[Sequence[float]], trainer_logprobs: Any) -> float:
    """Max |engine - trainer| over every token (trainer_logprobs is a padded [batch, T] tensor)."""
    gap = 0.0
    for i, row in enumerate(engine_logprobs):
        for j, value in enumerate(row):
            gap = max(gap, abs(float(value) - float(trainer_logprobs[i, j])))
    return gap


def _memory_phase(engine: Engine) -> tuple[Callable[[], None], Callable[[], None], str]:
    caps = engine.capabilities
    if caps.supports(Capability.MEMORY_RELEASE):
        return engine.release_memory, engine.resume_memory, "released+resumed"
    reason = caps.notes.get(Capability.MEMORY_RELEASE.value, "")
    label = f"not supported on {caps.platform} (skipped)"
    return (lambda: None), (lambda: None), label + (f": {reason}" if reason else "")


def run(
    cfg: DemoConfig,
    on_start: Callable[[RunInfo], None] = lambda info: None,
    on_step: Callable[[StepRecord], None] = lambda record: None,
) -> tuple[RunInfo, list[StepRecord]]:
    """Run the demo; ``on_start``/``on_step`` report progress. Returns the run's info and steps."""
    import torch
    from transformers import AutoTokenizer

    from rlinfer_demo.task import DigitTask
    from rlinfer_demo.trainer import Policy, group_advantages

    torch.manual_seed(cfg.seed)
    task = DigitTask.from_tokenizer(AutoTokenizer.from_pretrained(cfg.model), cfg.num_prompts)
    policy = Policy(cfg.model, lr=cfg.lr, seed=cfg.seed)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    engine = open_engine(cfg.backend, engine_config(cfg))
    with engine:
        caps = engine.capabilities
        release, resume, memory_label = _memory_phase(engine)
        info = RunInfo(
            backend=cfg.backend,
            engine_version=caps.engine_version,
            platform=caps.platform,
            capabilities=caps.to_dict(),
            memory_release=memory_label,
            engine_start_s=time.perf_counter() - started,
        )
        on_start(info)
        multi = caps.supports(Capability.MULTI_SAMPLE)
        records = []
        for step in range(cfg.steps):
            version = engine.weight_version
            t0 = time.perf_counter()
            completions: list[Completion] = engine.generate(build_requests(task.prompts, cfg, multi, step))
            generate_s = time.perf_counter() - t0
            prompts = [c.prompt_token_ids for c in completions]
            samples = [c.token_ids for c in completions]
            # Same weights the engine sampled with: the policy before this step's update.
            with torch.no_grad():
                old_logprobs, _ = policy.completion_logprobs(prompts, samples)
            gap = logprob_gap([c.logprobs for c in completions], old_logprobs)
            rewards = torch.tensor([task.reward(s) for s in samples])
            advantages = group_advantages(rewards, cfg.group_size)

            t0 = time.perf_counter()
            release()
            loss = policy.train_step(prompts, samples, old_logprobs, advantages)
            resume()
            train_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            engine.update_weights(NamedTensors.of(policy.named_parameters()))
            sync_s = time.perf_counter() - t0

            record = StepRecord(
                step=step,
                weight_version=version,
                reward_mean=float(rewards.mean()),
                reward_min=float(rewards.min()),
                reward_max=float(rewards.max()),
                logprob_gap_max=gap,
                tokens=sum(len(s) for s in samples),
                generate_s=generate_s,
                train_s=train_s,
                sync_s=sync_s,
                loss=loss,
                memory=memory_label,
            )
            records.append(record)
            on_step(record)
    return info, records
