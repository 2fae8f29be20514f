"""The bench's paired statistics and A/A control (rlinfer_demo.bench_stats, bench_sides): no engine."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from rlinfer_demo.bench_sides import paired, rotated, time_generate, with_control
from rlinfer_demo.bench_stats import describe, oriented_control, paired_report, ratios, summary, versus_control


def _noisy(center: float, n: int, seed: int, spread: float = 0.05) -> list[float]:
    rng = random.Random(seed)
    return [center * rng.uniform(1 - spread, 1 + spread) for _ in range(n)]


def test_ratios_are_per_run_and_need_the_same_runs() -> None:
    assert ratios([2.0, 3.0], [1.0, 4.0]) == [2.0, 0.75]
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])


def test_summary_gives_median_quartiles_range_and_an_interval_around_the_median() -> None:
    s = summary([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (5, 3.0, 1.0, 100.0)
    assert s["iqr"] == [2.0, 4.0]
    low, high = s["ci95"]
    assert 1.0 <= low <= s["median"] <= high <= 100.0
    assert summary([1.0, 2.0, 3.0, 4.0, 100.0]) == s  # seeded: the same samples, the same figures
    one = summary([0.9])
    assert one["iqr"] == [0.9, 0.9] and one["ci95"] == [0.9, 0.9]
    with pytest.raises(ValueError):
        summary([])


def test_a_real_shift_is_distinguishable_from_the_control_and_noise_is_not() -> None:
    control = _noisy(1.0, 15, seed=1)
    shifted = versus_control(_noisy(0.8, 15, seed=2), control)
    assert shifted["distinguishable"] is True
    assert shifted["ci95"][1] < 0 and shifted["median_difference"] == pytest.approx(-0.2, abs=0.05)
    same = versus_control(_noisy(1.0, 15, seed=3), control)
    assert same["distinguishable"] is False
    assert same["ci95"][0] <= 0 <= same["ci95"][1]
    # two samples of the same ±30 % noise: called different rarely (a 95 % interval: ~5 %)
    false_alarms = sum(
        versus_control(_noisy(1.0, 15, 100 + k, 0.3), _noisy(1.0, 15, 200 + k, 0.3))["distinguishable"]
        for k in range(60)
    )
    assert false_alarms <= 6
    with pytest.raises(ValueError):
        versus_control([1.0, 1.0], [1.0])


def test_paired_report_attaches_the_control_to_every_ratio_whose_sides_ran() -> None:
    samples = {"rlinfer": [90.0, 95.0, 92.0], "raw": [100.0, 100.0, 100.0], "raw_control": [101.0, 99.0, 100.0]}
    report = paired_report(
        samples,
        [("rlinfer/raw", "rlinfer", "raw"), ("pool/rlinfer", "pool", "rlinfer")],
        ("raw/raw_control", "raw", "raw_control"),
    )
    assert list(report["ratios"]) == ["rlinfer/raw"]  # no pool side ran
    assert report["control"]["name"] == "raw/raw_control"
    assert report["control"]["median"] == pytest.approx(1.0)
    assert report["ratios"]["rlinfer/raw"]["median"] == pytest.approx(0.92)
    assert report["ratios"]["rlinfer/raw"]["vs_control"]["control_order"] == "same"
    text = describe("rlinfer/raw", report["ratios"]["rlinfer/raw"], report["control"])
    assert "A/A control raw/raw_control" in text and "noise" in text
    without = paired_report({"rlinfer": [1.0], "raw": [1.0]}, [("rlinfer/raw", "rlinfer", "raw")], ("c", "raw", "x"))
    assert without["control"] is None and "vs_control" not in without["ratios"]["rlinfer/raw"]
    assert paired([2.0, 4.0], [1.0, 2.0])["samples"] == [2.0, 2.0]


def test_the_control_is_alternated_like_the_ratio_it_is_the_noise_floor_of() -> None:
    order: list[list[str]] = []

    def side(name: str) -> Any:
        async def run(batch: list[Any]) -> int:
            order[-1].append(name)
            return 1

        return run

    sides = with_control({"rlinfer": side("rlinfer"), "raw": side("raw"), "pool": side("pool")}, "raw")
    assert list(sides) == ["rlinfer", "raw", "raw_control", "pool"]
    assert sides["raw_control"] is sides["raw"]

    def batch(run: int) -> list[Any]:
        order.append([])
        return []

    rates, _ = asyncio.run(time_generate(sides, batch, runs=8))
    assert all(len(v) == 8 for v in rates.values())
    assert len(order) == 9 and all(len(run) == 4 for run in order)  # a warm-up run, not counted

    def gaps(first: str, second: str) -> list[int]:
        """How far ``second`` runs after ``first`` in each run's order (mod the rotation)."""
        return [
            (rotated(list(sides), run).index(second) - rotated(list(sides), run).index(first)) % 4 for run in range(8)
        ]

    # who goes first and how far apart: the same for rlinfer/raw as for raw/raw_control
    assert gaps("rlinfer", "raw") == gaps("raw", "raw_control") == [1] * 8
    leads = [rotated(list(sides), run)[0] for run in range(8)]
    assert leads.count("rlinfer") == leads.count("raw") == leads.count("raw_control") == 2


def test_the_control_is_oriented_like_each_ratio_in_the_rotation() -> None:
    control = [0.9, 1.0, 1.25]
    server = ["rlinfer", "raw", "raw_control", "inprocess"]
    pair = ("raw", "raw_control")
    assert oriented_control(control, server, ("rlinfer", "raw"), pair) == (control, "same")
    # inprocess runs right before rlinfer (cyclically): rlinfer/inprocess is raw_control/raw
    assert oriented_control(control, server, ("rlinfer", "inprocess"), pair) == ([1 / 0.9, 1.0, 0.8], "inverted")
    pools = ["rlinfer", "raw", "raw_control", "pool", "pool_one"]
    assert oriented_control(control, pools, ("pool", "pool_one"), pair)[1] == "same"
    assert oriented_control(control, pools, ("pool", "rlinfer"), pair) == (control, "unmatched")
    # an order effect alone (the first of two back-to-back sides 10 % slower): raw/raw_control
    # shows 0.9 in every run, rlinfer/inprocess (inprocess first) 1/0.9; the same effect, no overhead
    effect = {"rlinfer": [1.0] * 6, "raw": [0.9] * 6, "raw_control": [1.0] * 6, "inprocess": [0.9] * 6}
    report = paired_report(effect, [("rlinfer/inprocess", "rlinfer", "inprocess")], ("c", "raw", "raw_control"))
    vs = report["ratios"]["rlinfer/inprocess"]["vs_control"]
    assert vs["control_order"] == "inverted"
    assert vs["median_difference"] == pytest.approx(0.0) and vs["distinguishable"] is False
    # compared with the control as is, the same effect would look like an 11 % + 10 % difference
    assert versus_control(ratios(effect["rlinfer"], effect["inprocess"]), [0.9] * 6)["distinguishable"] is True
