"""``rlinfer demo``: argument checks with clear errors, then the run and its report."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from rlinfer_core.discovery import get_backend
from rlinfer_core.errors import BackendLoadError, BackendNotFound, InvalidRequest, UnsupportedCapability

DEFAULT_STEPS = 30


def repo_root() -> Path | None:
    """The project checkout (holding ``dev/envs/build_env.sh``) above the cwd or this package."""
    for start in (Path.cwd(), Path(__file__).resolve()):
        for candidate in (start, *start.parents):
            if (candidate / "dev" / "envs" / "build_env.sh").is_file():
                return candidate
    return None


def env_hint(name: str) -> str:
    """How to get a backend's environment, when the project has a recipe for it ('' if none)."""
    root = repo_root()
    if root is None:
        return ""
    envs = root / "dev" / "envs"
    if not ((envs / f"{name}-cpu.txt").is_file() or (envs / f"{name}.txt").is_file()):
        return ""
    venv = root / ".venvs" / name
    if Path(sys.prefix).resolve() == venv.resolve():
        return ""  # already in that environment: the error itself is what to fix
    if not (venv / "bin" / "python").exists():
        state = "does not exist yet"
    elif not (venv / ".built").exists():
        state = "is incomplete"
    else:
        state = "exists but is not the interpreter running this command"
    return (
        f" The {name!r} backend lives in its own environment .venvs/{name}, which {state}: "
        f"build it with `make env-{name}`, then run "
        f"`.venvs/{name}/bin/rlinfer demo --backend {name}`."
    )


def check_backend(name: str) -> None:
    """Fail fast, before torch is imported, if ``name`` cannot run in this interpreter."""
    try:
        get_backend(name).engine_version()
    except BackendNotFound as exc:
        hint = env_hint(name)
        if hint:
            raise BackendNotFound(f"backend {name!r} is not installed in this environment.{hint}") from exc
        raise
    except BackendLoadError as exc:
        raise BackendLoadError(f"{exc}{env_hint(name)}") from exc


def check_model(path: str) -> None:
    """Raise InvalidRequest unless ``path`` is a local HF causal-LM directory."""
    model = Path(path)
    if not model.exists():
        raise InvalidRequest("model", f"{path!r} does not exist; give a local Hugging Face model directory")
    if not model.is_dir() or not (model / "config.json").is_file():
        raise InvalidRequest("model", f"{path!r} is not a Hugging Face model directory (no config.json)")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(model))
    except Exception as exc:
        raise InvalidRequest("model", f"cannot read {path}/config.json: {exc}") from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InvalidRequest(
            "model",
            f"{path!r} is a {config.model_type!r} model, not a causal LM; the demo needs a decoder-only "
            f"text model (e.g. llama, qwen2)",
        )


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed ``rlinfer demo`` arguments; 0 when parity held at every step.

    The terminal shows the progress display only; the engine's logs go to ``OUT/engine.log``
    (``--verbose`` shows them instead).
    """
    from rlinfer_demo.console import engine_logs_to

    steps = DEFAULT_STEPS if args.steps is None else args.steps
    if steps < 1:
        raise InvalidRequest("steps", f"must be >= 1, got {steps}")
    check_backend(args.backend)
    if args.model is not None:
        check_model(args.model)
    out = Path(args.out)
    log_path = out / "engine.log"
    run = _run_agent if getattr(args, "task", "digits") == "agent" else _run
    with engine_logs_to(log_path, verbose=getattr(args, "verbose", False)) as console:
        code = run(args, out, steps, console)
        if not getattr(args, "verbose", False):
            console.print(f"engine logs: {log_path}")
    return code


def _run(args: argparse.Namespace, out: Path, steps: int, console: Any) -> int:
    from rlinfer_demo.loop import DemoConfig, run
    from rlinfer_demo.report import Display, write_plots, write_report

    if args.model is None:
        from rlinfer_core.tiny_model import make_tiny_model

        model = str(make_tiny_model(out / "tiny_model", seed=0))
    else:
        model = str(Path(args.model).resolve())
    cfg = DemoConfig(backend=args.backend, model=model, out=str(out), steps=steps)

    started = time.perf_counter()
    with Display(cfg.steps, cfg.parity_tolerance, console) as display:
        info, records = run(cfg, on_start=display.started, on_step=display.step)
    total_s = time.perf_counter() - started
    write_plots(out, info, records, cfg.parity_tolerance)
    report = write_report(out, cfg, info, records, total_s)
    s = report["summary"]
    console.print(
        f"reward {s['reward_first']:.3f} (first {s['window']} steps) -> {s['reward_last']:.3f} "
        f"(last {s['window']}); max |dlogprob| {s['max_logprob_gap']:.2e} "
        f"(tolerance {s['parity_tolerance']:g}); median sync {s['sync_s_median'] * 1e3:.1f} ms; "
        f"{total_s:.0f} s in all"
    )
    console.print(f"wrote {out / 'report.json'} and {', '.join(report['plots'])}")
    if not s["parity_ok_every_step"]:
        console.print("[red]trainer/engine logprobs disagree beyond the tolerance[/red]")
        return 1
    if not s["reward_rose"]:
        console.print("[yellow]the reward did not rise clearly; try more --steps[/yellow]")
    return 0


def _run_agent(args: argparse.Namespace, out: Path, steps: int, console: Any) -> int:
    """``--task agent`` (:mod:`rlinfer_demo.agent`): one line per step, then the summary."""
    from rlinfer_demo.agent import AgentConfig, make_agent_model, run_agent, write_agent_outputs

    if args.model is None:
        model = str(make_agent_model(out / "agent_model", seed=0))
    else:
        model = str(Path(args.model).resolve())
    cfg = AgentConfig(backend=args.backend, model=model, out=str(out), steps=steps)
    started = time.perf_counter()

    def on_start(info: dict[str, Any]) -> None:
        console.print(
            f"engine {info['engine_version']} on {info['platform']} up in {info['engine_start_s']:.1f} s; "
            f"sessions with the calc tool, logprobs_mode={info['logprobs_mode']}"
        )

    def on_step(r: Any) -> None:
        console.print(
            f"step {r.step:3d}  reward {r.reward_mean:.3f}  call args right {r.call_ok:.2f}  "
            f"answer = tool result {r.answer_ok:.2f}  max |dlogprob| {r.logprob_gap_max:.1e}  "
            f"rollout {r.rollout_s:.2f} s  train {r.train_s:.2f} s  sync {r.sync_s * 1e3:.0f} ms"
        )

    try:
        info, records = run_agent(cfg, on_start=on_start, on_step=on_step)
    except UnsupportedCapability as exc:  # the task needs sessions, tools and structured output
        console.print(f"[yellow]agent task skipped: {exc}[/yellow]")
        return 0
    s = write_agent_outputs(out, cfg, info, records)
    console.print(
        f"agent reward {s['reward_first']:.3f} (first {s['window']} steps) -> {s['reward_last']:.3f} "
        f"(last {s['window']}); {time.perf_counter() - started:.0f} s in all; "
        f"wrote {out / 'agent_report.json'} and {out / 'agent_reward.png'}"
    )
    if s["parity_ok_every_step"] is False:
        console.print("[red]trainer/engine logprobs disagree beyond the tolerance[/red]")
        return 1
    return 0
