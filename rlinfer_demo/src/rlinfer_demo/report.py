"""Progress display (rich), report.json and PNG plots (matplotlib, headless)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_demo.loop import DemoConfig, RunInfo, StepRecord

if TYPE_CHECKING:
    from rich.console import Console

#: how many first/last steps the summary averages to decide that the reward rose
WINDOW = 3
#: the last steps' mean reward must beat the first steps' by at least this much
MIN_RISE = 0.2


def summarize(records: Sequence[StepRecord], parity_tolerance: float) -> dict[str, Any]:
    """Reward of the first/last steps, parity verdict and timing medians."""
    if not records:
        return {"steps": 0}
    window = min(WINDOW, max(1, len(records) // 2))
    first = sum(r.reward_mean for r in records[:window]) / window
    last = sum(r.reward_mean for r in records[-window:]) / window
    syncs = sorted(r.sync_s for r in records)
    gaps = [r.logprob_gap_max for r in records]
    return {
        "steps": len(records),
        "window": window,
        "reward_first": first,
        "reward_last": last,
        "reward_rose": last - first >= MIN_RISE,
        "max_logprob_gap": max(gaps),
        "parity_tolerance": parity_tolerance,
        "parity_ok_every_step": all(g <= parity_tolerance for g in gaps),
        "sync_s_median": syncs[len(syncs) // 2],
        "tokens_total": sum(r.tokens for r in records),
    }


def write_report(
    out: Path, cfg: DemoConfig, info: RunInfo, records: Sequence[StepRecord], total_s: float
) -> dict[str, Any]:
    """Write ``out/report.json`` and return its content."""
    report = {
        "config": attrs.asdict(cfg),
        "engine": attrs.asdict(info),
        "summary": summarize(records, cfg.parity_tolerance),
        "total_s": total_s,
        "steps": [attrs.asdict(r) for r in records],
        "plots": [p.name for p in plot_paths(out)],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def plot_paths(out: Path) -> tuple[Path, Path, Path]:
    """Where the three plots go: reward curve, sync time, logprob gap."""
    return out / "reward.png", out / "sync_time.png", out / "logprob_gap.png"


def write_plots(out: Path, info: RunInfo, records: Sequence[StepRecord], parity_tolerance: float) -> None:
    """Draw the reward curve, the sync time per step and the trainer/engine logprob gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    title = f"rlinfer demo: {info.backend} {info.engine_version} ({info.platform})"
    reward_png, sync_png, gap_png = plot_paths(out)

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.fill_between(steps, [r.reward_min for r in records], [r.reward_max for r in records], alpha=0.2, label="min-max")
    ax.plot(steps, [r.reward_mean for r in records], marker="o", ms=3, label="mean reward")
    ax.set(xlabel="step", ylabel="reward (fraction of digit tokens)", ylim=(-0.02, 1.02), title=title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(reward_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, [r.sync_s * 1e3 for r in records], marker="o", ms=3, label="update_weights")
    ax.set(xlabel="step", ylabel="weight sync time (ms)", title=title)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(sync_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    gaps = [max(r.logprob_gap_max, 1e-12) for r in records]
    ax.semilogy(steps, gaps, marker="o", ms=3, label="max |trainer - engine| logprob")
    ax.axhline(parity_tolerance, color="red", ls="--", label=f"tolerance {parity_tolerance:g}")
    ax.set(xlabel="step", ylabel="logprob gap", title=title)
    ax.set_ylim(min(1e-8, min(gaps) / 10), parity_tolerance * 5)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(gap_png, dpi=110)
    plt.close(fig)


class Display:
    """Per-step progress with rich: a bar plus one line per step (reward, sync, parity)."""

    def __init__(self, total_steps: int, parity_tolerance: float, console: Console | None = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console if console is not None else Console()
        self.tolerance = parity_tolerance
        self.progress = Progress(
            TextColumn("[bold]GRPO[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("starting engine", total=total_steps)

    def __enter__(self) -> Display:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def started(self, info: RunInfo) -> None:
        """Print the engine facts once it is up."""
        self.console.print(
            f"engine [bold]{info.backend}[/bold] {info.engine_version} on {info.platform}, "
            f"started in {info.engine_start_s:.1f} s; memory release: {info.memory_release}"
        )
        self.console.print(" step  version  reward (min-max)     parity max|dlogp|   sync ms  gen s  train s")
        self.progress.update(self.task, description="")

    def step(self, r: StepRecord) -> None:
        """Print one step's numbers."""
        ok = "[green]ok[/green]" if r.logprob_gap_max <= self.tolerance else "[red]FAIL[/red]"
        self.console.print(
            f"{r.step:5d}  {r.weight_version:7d}  {r.reward_mean:.3f} ({r.reward_min:.2f}-{r.reward_max:.2f})"
            f"   {r.logprob_gap_max:9.2e} {ok}     {r.sync_s * 1e3:7.1f}  {r.generate_s:5.2f}  {r.train_s:7.2f}"
        )
        self.progress.update(self.task, advance=1, description=f"reward {r.reward_mean:.3f}")
