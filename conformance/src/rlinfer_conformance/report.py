"""The JSON report of one kit run: backend, platform, outcomes, skips, parity numbers, timings."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import attrs


@attrs.define
class KitReport:
    """Collects results while the kit runs; :meth:`write` dumps them as JSON."""

    backend: str
    profile: str
    started_at: float = attrs.field(factory=time.time)
    capabilities: dict[str, Any] | None = None
    engine_version: str | None = None
    engine_platform: str | None = None
    tests: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    skipped_capabilities: dict[str, list[str]] = attrs.field(factory=dict)
    parity: list[dict[str, Any]] = attrs.field(factory=list)
    timings: dict[str, float] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    #: with ``--rlinfer-configuration``: per configuration, its fields, capabilities and engine start
    configurations: list[dict[str, Any]] = attrs.field(factory=list)

    def record_parity(
        self, checkpoint: str, max_abs_logprob_delta: float, tokens: int, mismatches: int, architecture: str = "llama"
    ) -> None:
        """Remember the parity measured at ``checkpoint`` (e.g. "start", "after_update_1") on the
        tiny model of ``architecture``."""
        self.parity.append(
            {
                "architecture": architecture,
                "checkpoint": checkpoint,
                "max_abs_logprob_delta": max_abs_logprob_delta,
                "tokens_checked": tokens,
                "argmax_mismatches": mismatches,
            }
        )

    def record_skip(self, nodeid: str, capabilities: list[str]) -> None:
        """Remember that ``nodeid`` was skipped because these capabilities are not claimed."""
        self.skipped_capabilities[nodeid] = capabilities

    def record_test(self, nodeid: str, outcome: str, duration: float, detail: str | None) -> None:
        """Remember one test's outcome (the worst phase wins)."""
        entry = self.tests.setdefault(nodeid, {"outcome": "passed", "duration_s": 0.0})
        entry["duration_s"] = round(entry["duration_s"] + duration, 4)
        if outcome != "passed" and entry["outcome"] == "passed":
            entry["outcome"] = outcome
            if detail:
                entry["detail"] = detail[-3000:]  # the error message is at the end

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        outcomes: dict[str, int] = {}
        for entry in self.tests.values():
            outcomes[entry["outcome"]] = outcomes.get(entry["outcome"], 0) + 1
        deltas = [p["max_abs_logprob_delta"] for p in self.parity]
        by_architecture: dict[str, dict[str, Any]] = {}
        for p in self.parity:
            entry = by_architecture.setdefault(
                p["architecture"], {"max_abs_logprob_delta": 0.0, "tokens_checked": 0, "checkpoints": 0}
            )
            entry["max_abs_logprob_delta"] = max(entry["max_abs_logprob_delta"], p["max_abs_logprob_delta"])
            entry["tokens_checked"] += p["tokens_checked"]
            entry["checkpoints"] += 1
        return {
            "backend": self.backend,
            "engine_version": self.engine_version,
            "platform": {
                "engine_platform": self.engine_platform,
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "system": platform.platform(),
            },
            "hypothesis_profile": self.profile,
            "capabilities": self.capabilities,
            "summary": outcomes,
            "max_abs_logprob_delta": max(deltas) if deltas else None,
            "parity_by_architecture": by_architecture,
            "parity": self.parity,
            "skipped_capabilities": self.skipped_capabilities,
            "timings_s": {k: round(v, 4) for k, v in self.timings.items()},
            "wall_s": round(time.time() - self.started_at, 2),
            "tests": self.tests,
            "notes": self.notes,
            "configurations": self.configurations,
        }

    def write(self, path: str | Path) -> None:
        """Write the report as JSON to ``path`` (parents created)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=1, default=str))
