"""Bytes a delta weight sync moves vs a full sync, over real GRPO steps of the demo.

Runs the demo's loop (rlinfer_demo: generate n=G, GRPO loss, one AdamW step) on the tiny model
(or ``--model``) and syncs each step's weights with ``update_weights(tracker.delta(...))``
(:class:`rlinfer_core.delta.DeltaTracker`), i.e. a real delta through the engine. Per step it
reports the bytes of the delta (tensor granularity: what rlinfer sends), the full-sync bytes,
their ratio, and for information the share of rows (first-dimension slices) that changed, i.e.
what a row-granular delta would move. After the last step the engine's served weights are
compared with the trainer's (weights.checksum) where the backend claims it.

    timeout 900 .venvs/vllm/bin/python dev/bench/delta_bytes.py --backend vllm --steps 2 \
        --json-out bench/results/delta-bytes-vllm-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def changed_rows(previous: dict[str, Any], current: list[tuple[str, Any]]) -> tuple[int, int]:
    """(bytes of the rows that changed, bytes of all rows) at first-dimension granularity."""
    changed = total = 0
    for name, t in current:
        old = previous[name]
        row_bytes = t[0].numel() * t.element_size() if t.dim() else t.element_size()
        rows = t.shape[0] if t.dim() else 1
        diff = (old != t).reshape(rows, -1).any(dim=1) if t.dim() else (old != t).reshape(1)
        changed += int(diff.sum()) * row_bytes
        total += rows * row_bytes
    return changed, total


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Open the engine, run ``args.steps`` GRPO steps with delta syncs; one record per step."""
    import torch
    from transformers import AutoTokenizer

    from rlinfer_core.delta import DeltaTracker
    from rlinfer_core.engine import open_engine
    from rlinfer_core.tiny_model import make_tiny_model
    from rlinfer_core.types import Capability
    from rlinfer_demo.loop import DemoConfig, build_requests, engine_config
    from rlinfer_demo.task import DigitTask
    from rlinfer_demo.trainer import Policy, group_advantages

    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0))
    cfg = DemoConfig(backend=args.backend, model=model, out=tempfile.mkdtemp(), steps=args.steps)
    torch.manual_seed(cfg.seed)
    task = DigitTask.from_tokenizer(AutoTokenizer.from_pretrained(cfg.model), cfg.num_prompts)
    policy = Policy(cfg.model, lr=cfg.lr, seed=cfg.seed)
    result: dict[str, Any] = {
        "bench": "delta_bytes",
        "backend": args.backend,
        "model": "tiny (rlinfer_core.tiny_model, seed 0)" if args.model is None else args.model,
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "demo": {"num_prompts": cfg.num_prompts, "group_size": cfg.group_size, "lr": cfg.lr, "optimizer": "AdamW"},
        "steps": [],
    }
    with open_engine(cfg.backend, engine_config(cfg)) as engine:
        result["engine_version"] = engine.capabilities.engine_version
        result["platform"] = engine.capabilities.platform
        engine.capabilities.require(Capability.WEIGHTS_DELTA)
        tracker = DeltaTracker(policy.named_parameters(), version=engine.weight_version)
        multi = engine.capabilities.supports(Capability.MULTI_SAMPLE)
        for step in range(cfg.steps):
            completions = engine.generate(build_requests(task.prompts, cfg, multi, step))
            prompts = [c.prompt_token_ids for c in completions]
            samples = [c.token_ids for c in completions]
            with torch.no_grad():
                old_logprobs, _ = policy.completion_logprobs(prompts, samples)
            rewards = torch.tensor([task.reward(s) for s in samples])
            before = {n: t.clone() for n, t in policy.named_parameters()}
            loss = policy.train_step(prompts, samples, old_logprobs, group_advantages(rewards, cfg.group_size))
            current = policy.named_parameters()
            delta = tracker.delta(current)
            started = time.perf_counter()
            version = engine.update_weights(delta) if delta.tensors else engine.weight_version
            sync_s = time.perf_counter() - started
            tracker.commit(delta, version)
            rows_changed, rows_total = changed_rows(before, current)
            record = {
                "step": step,
                "loss": loss,
                "reward_mean": float(rewards.mean()),
                "delta_tensors": len(delta.tensors),
                "tensors": len(current),
                "delta_bytes": delta.nbytes,
                "full_bytes": tracker.nbytes,
                "delta_over_full": delta.nbytes / tracker.nbytes,
                "changed_row_bytes_over_full": rows_changed / rows_total,
                "sync_s": sync_s,
                "weight_version": version,
            }
            result["steps"].append(record)
            print(json.dumps(record), flush=True)
        if engine.capabilities.supports(Capability.WEIGHTS_CHECKSUM):
            check = engine.verify_weights(policy.named_parameters())
            result["served_equals_trainer"] = check.ok
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--model", default=None, help="local HF causal LM dir (default: the tiny model)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args)
    result["command"] = " ".join(sys.argv)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0 if result.get("served_equals_trainer", True) else 1


if __name__ == "__main__":
    sys.exit(main())
