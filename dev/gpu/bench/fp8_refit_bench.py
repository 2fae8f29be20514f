"""FP8 rollout from BF16 training (capability ``weights.quantized_reload``): refit time and parity.

On one GPU, through rlinfer's public API, the same BF16 model served twice, one engine at a time:

1. ``bf16``: the engine in BF16 (the reference);
2. ``fp8``: the engine started with ``engine_kwargs={"quantization": "fp8"}`` (online FP8: the
   engine quantizes the BF16 checkpoint itself, and every update, on reload).

For each: the median wall time of ``--repeats`` full-model ``update_weights(NamedTensors)`` with
CUDA BF16 tensors in the checkpoint's names (alternating two weight sets, after a warm-up), and
teacher-forced logprobs (``Engine.score``) of the BF16 engine's greedy continuations of a few
prompts. Reported: ``fp8_refit_ratio`` = FP8 median / BF16 median (the issue's goal: <= 1.5),
``max |dlogprob|`` of FP8 against the BF16 engine (and both against a transformers BF16 oracle
with ``--hf-oracle``), and that an FP8 update is really served: the logprobs move after a
perturbed update and come back after the original weights are sent again; the vLLM backend's
``quantized_check()`` (served FP8 weights within E4M3 rounding of the sent ones) where it exists.
Parity is measured and reported, not asserted.

``--device cpu`` is a dry run of the plumbing (no GPU, no FP8: neither engine quantizes on CPU):
the second phase runs the BF16 engine again under the name ``fp8-dry``, and the FP8 engine's
refusal (``UnsupportedCapability`` before it starts) is recorded.

    python3 dev/gpu/bench/fp8_refit_bench.py --backend vllm --model /tmp/rlinfer_model \\
        --json-out $OUT/fp8-vllm.json

Writes one JSON document; exits 1 if any stage raised (the error is in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

GB = 1e9

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync_bench import WorkerTimings, prefix_agreement, stats, write_outcome  # noqa: E402

#: per-update timings logged by the backend's worker (rlinfer_vllm: load_s, map_s, shadow_s)
WORKER_TIMINGS = WorkerTimings()


def sync(device: str) -> None:
    """Wait for the GPU (nothing on CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of fn() with the GPU synchronised on both sides."""
    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - started, result


def max_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> dict[str, float]:
    """Largest and mean |a - b| over every position of every sequence."""
    diffs = [abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs), "n": len(diffs)}


def weight_sets(
    specs: Any, model_dir: Path, device: str, perturb: float, seed: int
) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]], int]:
    """Weights A (the checkpoint, in the dtypes of ``weight_specs``: BF16 for a BF16 engine, FP8
    or not) and B (A plus ``perturb`` times each tensor's std of noise), on ``device``; bytes."""
    import torch

    from rlinfer_core.transfer.buckets import to_dtype
    from rlinfer_core.transfer.disk import read_tensors

    a = [(n, t.to(device=device, dtype=to_dtype(specs[n].dtype))) for n, t in read_tensors(model_dir) if n in specs]
    missing = sorted(set(specs) - {n for n, _ in a})
    if missing:
        raise RuntimeError(f"checkpoint lacks {len(missing)} parameters the engine wants, e.g. {missing[:3]}")
    gen = torch.Generator(device=device).manual_seed(seed)
    b = []
    for n, t in a:
        std = t.float().std() if t.numel() > 1 else t.float().abs()
        noise = torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32)
        b.append((n, (t.float() + perturb * std * noise).to(t.dtype)))
    return a, b, sum(t.numel() * t.element_size() for _, t in a)


def prompts_for(vocab: int, count: int, length: int) -> list[list[int]]:
    """Fixed token-id prompts (no tokenizer needed)."""
    return [[(97 * i + 31 * j) % (vocab - 16) + 16 for j in range(length)] for i in range(count)]


def scores(engine: Any, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[list[float]]:
    """Teacher-forced logprobs of each continuation after its prompt."""
    from rlinfer_core.scoring import ScoreRequest

    out = engine.score([ScoreRequest(p, c) for p, c in zip(prompts, continuations, strict=True)])
    return [list(s.logprobs) for s in out]


def run_phase(args: argparse.Namespace, name: str, quantization: str | None, shared: dict[str, Any]) -> dict[str, Any]:
    """One engine: start, greedy continuations (the first phase's are kept for the others),
    logprobs, refit timing, served check, shutdown."""
    import attrs

    from rlinfer_core import engine as rl_engine
    from rlinfer_core.types import Capability, EngineConfig, GenerateRequest, SamplingParams, parse_assignments
    from rlinfer_core.weights import NamedTensors

    device = args.device
    kwargs = dict(parse_assignments(args.engine_arg))
    if quantization is not None:
        kwargs["quantization"] = quantization
    config = EngineConfig(
        model=str(args.model),
        dtype="bfloat16",
        device=device,
        seed=0,
        enforce_eager=args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        verify_updates=args.verify_updates,
        engine_kwargs=kwargs,
    )
    phase: dict[str, Any] = {"quantization": quantization, "config": attrs.asdict(config)}
    start_s, engine = timed(device, lambda: rl_engine.open_engine(args.backend, config, load_entry_point_plugins=False))
    phase["engine_start_s"] = start_s
    phase["engine_version"] = engine.capabilities.engine_version
    phase["quantized_reload_claimed"] = engine.capabilities.supports(Capability.WEIGHTS_QUANTIZED_RELOAD)
    phase["verifies_updates"] = engine.verifies_updates
    try:
        assert engine.model_info is not None
        prompts = shared.setdefault("prompts", prompts_for(engine.model_info.vocab_size, args.prompts, args.prompt_len))
        greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        tokens = [
            list(c.token_ids)
            for c in engine.generate([GenerateRequest(prompt_token_ids=p, sampling=greedy) for p in prompts])
        ]
        continuations = shared.setdefault("continuations", tokens)
        phase["greedy_prefix_agreement_with_first_phase"] = prefix_agreement(continuations, tokens)
        base = scores(engine, prompts, continuations)
        phase["logprobs"] = base
        specs = engine.weight_specs
        phase["weight_specs_dtypes"] = sorted({s.dtype for s in specs.values()})
        a, b, nbytes = weight_sets(specs, args.model, device, args.perturb, seed=1)
        phase["weights"] = {"tensors": len(a), "bytes": nbytes, "gb": nbytes / GB}

        # refit: warm-up (A), then B, A, B, ... with A served at the end
        phase["warmup_s"] = timed(device, lambda: engine.update_weights(NamedTensors.of(a)))[0]
        after_same = scores(engine, prompts, continuations)
        seconds: list[float] = []
        after_b: list[list[float]] | None = None
        WORKER_TIMINGS.rows.clear()
        for i in range(args.repeats + (args.repeats % 2 == 1)):
            source = NamedTensors.of(b if i % 2 == 0 else a)
            seconds.append(timed(device, lambda source=source: engine.update_weights(source))[0])
            if i == 0:
                after_b = scores(engine, prompts, continuations)
        after_a = scores(engine, prompts, continuations)
        phase["refit_s"] = stats(seconds)
        # the worker's own split (vLLM): load_s (checks + vLLM's load/reload, or the fast FP8 path's
        # quantization: fast_fp8_updates counts those), shadow_s (the reload mode's host copy of the
        # update; absent for fast FP8 updates), map_s (mapping the CUDA-IPC handles), in ms
        phase["worker"] = WORKER_TIMINGS.summary()
        phase["refit_seconds"] = seconds
        phase["refit_gb_per_s"] = nbytes / GB / statistics.median(seconds)
        assert after_b is not None
        phase["served"] = {
            "same_weights_again_max_dlogprob": max_abs_diff(base, after_same)["max"],
            "perturbed_update_max_dlogprob": max_abs_diff(base, after_b)["max"],
            "restored_max_dlogprob": max_abs_diff(base, after_a)["max"],
        }
        served = phase["served"]
        served["update_is_served"] = served["perturbed_update_max_dlogprob"] > 10 * max(
            served["restored_max_dlogprob"], 1e-4
        )
        backend = getattr(getattr(engine, "async_engine", None), "_backend", None)
        if quantization is not None and hasattr(backend, "quantized_check"):
            check = engine._run(backend.quantized_check())
            phase["quantized_check"] = {k: v[:10] if isinstance(v, list) else v for k, v in check.items()}
            phase["quantized_check_s"] = timed(device, lambda: engine._run(backend.quantized_check()))[0]
        phase["weight_version"] = engine.weight_version
    finally:
        phase["shutdown_s"] = timed(device, engine.shutdown)[0]
    return phase


def hf_oracle(args: argparse.Namespace, shared: dict[str, Any]) -> list[list[float]]:
    """Teacher-forced logprobs of the continuations under transformers in BF16 on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.bfloat16)
    except TypeError:  # transformers before 4.56
        model = AutoModelForCausalLM.from_pretrained(str(args.model), torch_dtype=torch.bfloat16)
    model = model.to(args.device)
    out = []
    with torch.no_grad():
        for prompt, cont in zip(shared["prompts"], shared["continuations"], strict=True):
            ids = torch.tensor([list(prompt) + list(cont)], device=args.device)
            logits = model(ids).logits[0].float().log_softmax(-1)
            positions = range(len(prompt) - 1, len(prompt) + len(cont) - 1)
            out.append([float(logits[p, t]) for p, t in zip(positions, cont, strict=True)])
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def fp8_refusal(args: argparse.Namespace) -> str:
    """On CPU: open an FP8 engine and return the typed error it is refused with."""
    from rlinfer_core import engine as rl_engine
    from rlinfer_core.errors import UnsupportedCapability
    from rlinfer_core.types import EngineConfig

    config = EngineConfig(model=str(args.model), dtype="bfloat16", device="cpu", engine_kwargs={"quantization": "fp8"})
    try:
        engine = rl_engine.open_engine(args.backend, config, load_entry_point_plugins=False)
    except UnsupportedCapability as exc:
        return f"UnsupportedCapability: {exc}"
    engine.shutdown()
    raise RuntimeError("an FP8 engine started on CPU, where the backend does not claim weights.quantized_reload")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both phases, the comparisons, the oracle; failures are recorded and the rest still runs."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fp8_refit_bench: needs a CUDA GPU (or --device cpu for the dry run)")
    result: dict[str, Any] = {
        "bench": "fp8_refit",
        "backend": args.backend,
        "model": str(args.model),
        "device": args.device,
        "dry_run": args.device == "cpu",
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "errors": [],
    }
    shared: dict[str, Any] = {}
    second = ("fp8-dry", None) if args.device == "cpu" else ("fp8", "fp8")
    phases: dict[str, Any] = {}
    for name, quantization in (("bf16", None), second):
        try:
            phases[name] = run_phase(args, name, quantization, shared)
        except Exception as exc:
            result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            phases[name] = {"traceback": traceback.format_exc()}
    result["phases"] = phases
    if args.device == "cpu":
        try:
            result["fp8_on_cpu"] = fp8_refusal(args)
        except Exception as exc:
            result["errors"].append(f"fp8 refusal: {type(exc).__name__}: {exc}")
    ref, quant = phases.get("bf16", {}), phases.get(second[0], {})
    if "refit_s" in ref and "refit_s" in quant:
        result["fp8_refit_ratio"] = quant["refit_s"]["median"] / ref["refit_s"]["median"]
        result["fp8_refit_goal"] = 1.5
    if "logprobs" in ref and "logprobs" in quant:
        result["fp8_vs_bf16_dlogprob"] = max_abs_diff(ref["logprobs"], quant["logprobs"])
    if args.hf_oracle and "continuations" in shared:
        try:
            oracle = hf_oracle(args, shared)
            result["vs_hf_bf16_oracle"] = {
                name: max_abs_diff(oracle, phase["logprobs"]) for name, phase in phases.items() if "logprobs" in phase
            }
        except Exception as exc:
            result["errors"].append(f"hf oracle: {type(exc).__name__}: {exc}")
    result["prompts"] = shared.get("prompts")
    result["continuations"] = shared.get("continuations")
    return result


def summary(result: dict[str, Any]) -> str:
    """A short table for the end of the log."""
    lines = [f"fp8_refit_bench {result['backend']} on {result.get('gpu') or result.get('device')}"]
    for name, phase in result.get("phases", {}).items():
        if "refit_s" in phase:
            served = phase["served"]
            lines.append(
                f"{name}: start {phase['engine_start_s']:.1f} s, refit {phase['refit_s']['median']:.3f} s median "
                f"({phase['weights']['gb']:.2f} GB, {phase['refit_gb_per_s']:.1f} GB/s); perturbed update moves "
                f"logprobs by {served['perturbed_update_max_dlogprob']:.3g}, "
                f"restored {served['restored_max_dlogprob']:.3g} (served: {served['update_is_served']})"
            )
        if phase.get("worker"):
            worker = phase["worker"]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in worker.items() if k.endswith("_ms"))
            lines.append(f"{name}: worker medians (ms): {parts}")
        if "quantized_check" in phase:
            check = phase["quantized_check"]
            lines.append(
                f"{name}: quantized_check {check['quantized']} FP8 tensors (worst ratio {check['worst_ratio']:.3f} "
                f"at {check['worst_name']}), {check['exact']} exact, mismatched {check['mismatched']}"
            )
    if "fp8_refit_ratio" in result:
        lines.append(f"FP8 refit / BF16 refit = {result['fp8_refit_ratio']:.2f} (goal <= 1.5)")
    if "fp8_vs_bf16_dlogprob" in result:
        d = result["fp8_vs_bf16_dlogprob"]
        lines.append(f"|dlogprob| FP8 vs BF16 engine: max {d['max']:.4f}, mean {d['mean']:.4f} over {d['n']}")
    for name, d in result.get("vs_hf_bf16_oracle", {}).items():
        lines.append(f"|dlogprob| {name} vs HF bf16 oracle: max {d['max']:.4f}, mean {d['mean']:.4f}")
    if "fp8_on_cpu" in result:
        lines.append(f"FP8 on CPU: {result['fp8_on_cpu'][:200]}")
    lines += [f"ERROR {e}" for e in result.get("errors", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", type=Path, required=True, help="HF model dir with BF16 weights")
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: dry run without FP8")
    parser.add_argument("--repeats", type=int, default=6, help="timed full updates per phase (median reported)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (then scored)")
    parser.add_argument("--perturb", type=float, default=0.2, help="weights B = A + this x std(A) x noise")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="allow CUDA graphs / torch.compile")
    parser.add_argument(
        "--verify-updates",
        action="store_true",
        help="EngineConfig.verify_updates=True (off by default: the BF16 engine would add its checksum "
        "read-back to every refit, which the FP8 engine, without weights.checksum, does not do)",
    )
    parser.add_argument("--no-hf-oracle", dest="hf_oracle", action="store_false", help="skip the transformers oracle")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="engine_kwargs entry")
    args = parser.parse_args(argv)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    backend_logger = logging.getLogger(f"rlinfer_{args.backend}")
    backend_logger.setLevel(logging.DEBUG)  # per-update worker timings
    backend_logger.addHandler(WORKER_TIMINGS)
    return write_outcome(args, run, summary, "phases")


if __name__ == "__main__":
    sys.exit(main())
