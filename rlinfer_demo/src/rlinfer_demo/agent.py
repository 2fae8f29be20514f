"""``rlinfer demo --task agent``: a policy learns to call a calculator tool, through sessions.

Each episode is an :meth:`Engine.session` with the ``calc`` tool (hermes tool parser):

1. user: ``what is A + B? use the calc tool.``
2. model turn 1: a tool call. A random tiny model will never write the call format on its own,
   so the turn is **bootstrapped** with a structured-output regex that fixes the format and
   leaves the two argument digits to the model:
   ``<tool_call>{"name": "calc", "arguments": {"a": D, "b": D}}</tool_call>``;
3. tool: the session injects ``calc(a, b)`` as a tool message (environment tokens);
4. model turn 2: the answer, constrained to one or two digits.

Reward (verifiable): ``(a == A) + (b == B) + (answer == the tool's result)``, over 3: call the
tool with the question's numbers, and report what the tool said. The trainer trains on
``SessionResult.token_ids`` with ``loss_mask`` (model tokens only: never the question, the tool
result or the template) and the engine's per-token ``logprobs`` as the behaviour policy. The
session samples with ``logprobs_mode="raw"`` where the backend has it: the engine then reports
``log_softmax`` of the model's own logits, the same numbers the trainer computes, so the demo
checks trainer/engine parity on every model token (under ``processed`` the grammar mask would be
in the engine's numbers and not in the trainer's). Training on the grammar-forced tokens too
teaches the unconstrained policy the call format itself.

The tiny model's chat template closes a turn with ``<|end|>``; the agent model uses it as its EOS
(as instruct models do), so a constrained turn ends with the template's own marker and the
session stays exact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from rlinfer_core.engine import Engine, open_engine
from rlinfer_core.session import SessionResult
from rlinfer_core.tools import ToolSpec
from rlinfer_core.types import Capability, SamplingParams
from rlinfer_core.weights import NamedTensors

CALC = ToolSpec(
    "calc",
    "add two integers",
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
)
#: the call format the first model turn is held to (the model picks the two digits)
CALL_REGEX = r'<tool_call>\{"name": "calc", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'
ANSWER_REGEX = r"[0-9]{1,2}"
#: (A, B) of the questions, one GRPO group each. One question: within a demo's 30 steps the
#: 0.2M-parameter random model does not learn to read the numbers off the question (with two
#: questions it settles on one argument pair for both); it does learn one call and its answer.
QUESTIONS: tuple[tuple[int, int], ...] = ((2, 3),)
EOS_MARKER = "<|end|>"


@attrs.frozen
class AgentConfig:
    """One agent-demo run."""

    backend: str
    model: str
    out: str
    steps: int = 30
    group_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    temperature: float = 1.0
    #: looser than the single-turn demo's 1e-5 (the kit's, for short sequences): multi-turn
    #: episodes accumulate float32 kernel differences (vLLM CPU vs torch), measured up to 2.0e-5
    parity_tolerance: float = 1e-4


@attrs.frozen
class AgentStep:
    """What one step measured."""

    step: int
    reward_mean: float
    call_ok: float  #: fraction of episodes whose call had both arguments right
    answer_ok: float  #: fraction of episodes whose final answer was the tool's result
    #: max |trainer - engine| / max(1, |logprob|) over model tokens (raw mode; NaN otherwise)
    logprob_gap_max: float
    model_tokens: int
    exact: float  #: fraction of episodes that followed the chat template exactly (SessionResult.exact)
    rollout_s: float
    train_s: float
    sync_s: float


def make_agent_model(path: str | Path, seed: int = 0) -> Path:
    """The tiny random model with ``<|end|>`` (the template's end of turn) as its EOS."""
    from rlinfer_core.tiny_model import make_tiny_model

    folder = make_tiny_model(path, seed=seed)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = json.loads((folder / "tokenizer.json").read_text())
    end_id = next(t["id"] for t in vocab["added_tokens"] if t["content"] == EOS_MARKER)
    tok_cfg["eos_token"] = EOS_MARKER
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((folder / name).read_text())
        cfg["eos_token_id"] = end_id
        (folder / name).write_text(json.dumps(cfg, indent=1))
    return folder


def reward(episode: SessionResult, question: tuple[int, int]) -> tuple[float, bool, bool]:
    """(reward, call arguments right, answer = the tool's result) of one episode, from its turns."""
    a, b = question
    model_turns = [t for t in episode.turns if t.kind == "model"]
    call = model_turns[0].tool_calls.calls[0] if model_turns and model_turns[0].tool_calls else None
    args = dict(call.arguments or {}) if call is not None and call.ok else {}
    answer = (model_turns[-1].text or "").strip() if len(model_turns) > 1 else ""
    result = str(args["a"] + args["b"]) if isinstance(args.get("a"), int) and isinstance(args.get("b"), int) else None
    hits = [args.get("a") == a, args.get("b") == b, answer == result]
    return sum(hits) / 3.0, hits[0] and hits[1], hits[2]


def episode(engine: Engine, question: tuple[int, int], sampling: SamplingParams) -> SessionResult:
    """One episode: question, constrained tool call, tool result, constrained answer."""
    session = engine.session(tools=[CALC], tool_parser="hermes", sampling=sampling)
    session.add_message("user", f"what is {question[0]} + {question[1]}? use the calc tool.")
    turn = session.generate(attrs.evolve(sampling, max_tokens=96, structured={"regex": CALL_REGEX}))
    calls = turn.tool_calls.calls if turn.tool_calls else ()
    if calls and calls[0].ok:
        args = dict(calls[0].arguments or {})
        result = str(int(args["a"]) + int(args["b"]))
    else:
        result = f"error: {calls[0].error if calls else 'no tool call'}"
    session.add_tool_result(result, name="calc")
    session.generate(attrs.evolve(sampling, max_tokens=4, structured={"regex": ANSWER_REGEX}))
    return session.result()


def sequence_logprobs(model: Any, episodes: Sequence[SessionResult]) -> tuple[Any, Any, Any]:
    """Teacher-forced logprobs of every token after the first: ([B, T-1] logprobs with grad,
    [B, T-1] loss mask, [B, T-1] engine logprobs), right-padded."""
    import torch

    width = max(len(e.token_ids) for e in episodes)
    ids = torch.zeros((len(episodes), width), dtype=torch.long)
    attn = torch.zeros((len(episodes), width), dtype=torch.long)
    mask = torch.zeros((len(episodes), width - 1))
    engine_lp = torch.zeros((len(episodes), width - 1))
    for i, e in enumerate(episodes):
        n = len(e.token_ids)
        ids[i, :n] = torch.tensor(e.token_ids)
        attn[i, :n] = 1
        mask[i, : n - 1] = torch.tensor(e.loss_mask[1:], dtype=torch.float32)
        engine_lp[i, : n - 1] = torch.tensor(e.logprobs[1:], dtype=torch.float32)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp, mask, engine_lp


def episode_loss(logprobs: Any, old_logprobs: Any, advantages: Any, mask: Any, clip_eps: float = 0.2) -> Any:
    """Clipped policy-gradient loss summed over each episode's model tokens, averaged over
    episodes. (A per-token mean would give the two argument digits 2/55 of the weight of the
    grammar-forced format tokens, whose gradients mostly cancel within a group.)"""
    ratio = (logprobs - old_logprobs).exp()
    adv = advantages.unsqueeze(1)
    per_token = -(ratio * adv).minimum(ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    return (per_token * mask).sum() / logprobs.shape[0]


def run_agent(
    cfg: AgentConfig,
    on_start: Callable[[dict[str, Any]], None] = lambda info: None,
    on_step: Callable[[AgentStep], None] = lambda record: None,
) -> tuple[dict[str, Any], list[AgentStep]]:
    """Run the agent demo; returns (engine facts, per-step records)."""
    import torch

    from rlinfer_demo.loop import DemoConfig, engine_config
    from rlinfer_demo.trainer import Policy, group_advantages

    torch.manual_seed(cfg.seed)
    policy = Policy(cfg.model, lr=cfg.lr, seed=cfg.seed)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    base = engine_config(DemoConfig(backend=cfg.backend, model=cfg.model, out=cfg.out, seed=cfg.seed))
    config = attrs.evolve(base, max_model_len=512, max_num_seqs=len(QUESTIONS) * cfg.group_size)
    started = time.perf_counter()
    with open_engine(cfg.backend, config) as engine:
        caps = engine.capabilities
        for needed in (Capability.SESSIONS, Capability.TOOLS, Capability.STRUCTURED):
            caps.require(needed)
        raw = caps.supports(Capability.LOGPROBS_RAW)
        info = {
            "backend": cfg.backend,
            "engine_version": caps.engine_version,
            "platform": caps.platform,
            "logprobs_mode": "raw" if raw else "processed",
            "engine_start_s": time.perf_counter() - started,
        }
        on_start(info)
        sampling = SamplingParams(temperature=cfg.temperature, logprobs_mode="raw" if raw else "processed")
        jobs = [q for q in QUESTIONS for _ in range(cfg.group_size)]
        records = []
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            for step in range(cfg.steps):
                t0 = time.perf_counter()
                episodes = list(pool.map(lambda q: episode(engine, q, sampling), jobs))
                rollout_s = time.perf_counter() - t0
                scored = [reward(e, q) for e, q in zip(episodes, jobs, strict=True)]
                rewards = torch.tensor([s[0] for s in scored])
                advantages = group_advantages(rewards, cfg.group_size)

                t0 = time.perf_counter()
                logprobs, mask, engine_lp = sequence_logprobs(policy.model, episodes)
                # relative above |logprob| 1: fp32 rounding grows with the magnitude, and the tokens the
                # grammar forces reach raw logprobs near -30 (ulp 2e-6)
                scale = engine_lp.abs().clamp(min=1.0)
                gap = float(((logprobs.detach() - engine_lp).abs() / scale * mask).max()) if raw else float("nan")
                loss = episode_loss(logprobs, engine_lp if raw else logprobs.detach(), advantages, mask)
                policy.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
                policy.optimizer.step()
                train_s = time.perf_counter() - t0

                t0 = time.perf_counter()
                engine.update_weights(NamedTensors.of(policy.named_parameters()))
                sync_s = time.perf_counter() - t0
                record = AgentStep(
                    step=step,
                    reward_mean=float(rewards.mean()),
                    call_ok=sum(s[1] for s in scored) / len(scored),
                    answer_ok=sum(s[2] for s in scored) / len(scored),
                    logprob_gap_max=gap,
                    model_tokens=int(mask.sum()),
                    exact=sum(e.exact for e in episodes) / len(episodes),
                    rollout_s=rollout_s,
                    train_s=train_s,
                    sync_s=sync_s,
                )
                records.append(record)
                on_step(record)
    return info, records


def write_agent_outputs(
    out: Path, cfg: AgentConfig, info: dict[str, Any], records: Sequence[AgentStep]
) -> dict[str, Any]:
    """``agent_report.json`` and ``agent_reward.png`` in ``out``; returns the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = min(3, max(1, len(records) // 2))
    gaps = [r.logprob_gap_max for r in records if r.logprob_gap_max == r.logprob_gap_max]
    summary = {
        "steps": len(records),
        "window": window,
        "reward_first": sum(r.reward_mean for r in records[:window]) / window,
        "reward_last": sum(r.reward_mean for r in records[-window:]) / window,
        "call_ok_last": records[-1].call_ok,
        "answer_ok_last": records[-1].answer_ok,
        "max_logprob_gap": max(gaps) if gaps else None,
        "parity_ok_every_step": all(g <= cfg.parity_tolerance for g in gaps) if gaps else None,
        "rollout_s_median": sorted(r.rollout_s for r in records)[len(records) // 2],
    }
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r.step for r in records]
    ax.plot(steps, [r.reward_mean for r in records], label="reward")
    ax.plot(steps, [r.call_ok for r in records], label="call args right", linestyle="--")
    ax.plot(steps, [r.answer_ok for r in records], label="answer = tool result", linestyle=":")
    ax.set(xlabel="step", ylabel="fraction", ylim=(0, 1.05), title=f"agent task ({info['backend']}, calc tool)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "agent_reward.png", dpi=100)
    plt.close(fig)
    report = {
        "config": attrs.asdict(cfg),
        "engine": info,
        "steps": [attrs.asdict(r) for r in records],
        "summary": summary,
    }
    (out / "agent_report.json").write_text(json.dumps(report, indent=1))
    return summary
