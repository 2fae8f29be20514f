"""Statistics of paired bench runs: per-run ratios, their spread, and the A/A control.

A ratio such as rlinfer/raw is taken per run (both sides ran back to back on the same batch). Its
noise floor is an *A/A control* from the same runs: the raw engine timed a second time under
another name (``raw_control``), placed in the rotation right after ``raw`` just as ``raw`` comes
right after ``rlinfer``, so raw/raw_control is a ratio of two identical sides alternated the same
way. A ratio is *distinguishable* from the control when the 95 % interval of
``median(ratio) - median(control)``, bootstrapped over whole runs (both ratios of a run stay
together: they share the run's raw sample), excludes 0. A ratio whose sides stand the other way
round in the rotation (rlinfer/inprocess: inprocess comes last, right before rlinfer) is compared
with the inverted control, so first-vs-second effects cancel too. Stdlib only; seeded, so the
same samples always give the same figures.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: bootstrap resamples of the runs for every interval
RESAMPLES = 2000
#: the name the A/A control's second copy of a side gets (``raw`` -> ``raw_control``)
CONTROL_SUFFIX = "_control"


def ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-run ratios ``numerator[i] / denominator[i]``."""
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def _interval(values: list[float]) -> list[float]:
    """The central 95 % of bootstrap ``values`` (percentile interval)."""
    values.sort()
    return [values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]]


def _resampled(n: int, seed: int) -> list[list[int]]:
    """``RESAMPLES`` draws of ``n`` run indices with replacement (the same draws for every
    statistic of a call, so paired samples stay paired)."""
    rng = random.Random(seed)
    return [[rng.randrange(n) for _ in range(n)] for _ in range(RESAMPLES)]


def summary(samples: Sequence[float], seed: int = 0) -> dict[str, Any]:
    """Median, min, max, quartiles (IQR) and the bootstrap 95 % interval of the median."""
    data = list(samples)
    if not data:
        raise ValueError("no samples")
    q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive") if len(data) > 1 else (data[0],) * 3
    medians = [statistics.median(data[i] for i in draw) for draw in _resampled(len(data), seed)]
    return {
        "n": len(data),
        "median": statistics.median(data),
        "min": min(data),
        "max": max(data),
        "iqr": [q1, q3],
        "ci95": _interval(medians),
        "samples": data,
    }


def versus_control(ratio: Sequence[float], control: Sequence[float], seed: int = 0) -> dict[str, Any]:
    """``median(ratio) - median(control)`` with its run-bootstrap 95 % interval; distinguishable
    when the interval excludes 0. Both sequences come from the same runs (index = run)."""
    if len(ratio) != len(control) or not ratio:
        raise ValueError(f"need the same non-zero number of runs, got {len(ratio)} and {len(control)}")
    diffs = [
        statistics.median(ratio[i] for i in draw) - statistics.median(control[i] for i in draw)
        for draw in _resampled(len(ratio), seed)
    ]
    low, high = _interval(diffs)
    return {
        "median_difference": statistics.median(ratio) - statistics.median(control),
        "ci95": [low, high],
        "distinguishable": not low <= 0.0 <= high,
    }


def oriented_control(
    control: list[float], order: Sequence[str], pair: tuple[str, str], control_pair: tuple[str, str]
) -> tuple[list[float], str]:
    """The control samples alternated like ``pair`` (numerator, denominator) in the rotation
    ``order``, and how: ``"same"`` when the denominator follows the numerator by as many places
    as in ``control_pair``; ``"inverted"`` (1 / control) when the numerator follows the
    denominator by that many (e.g. rlinfer/inprocess with inprocess last); else ``"unmatched"``
    (the control as is: sides further apart meet other neighbours, the floor is approximate)."""

    def gap(first: str, second: str) -> int:
        return (order.index(second) - order.index(first)) % len(order)

    if gap(*pair) == gap(*control_pair):
        return control, "same"
    if gap(*pair) == len(order) - gap(*control_pair):
        return [1.0 / c for c in control], "inverted"
    return control, "unmatched"


def paired_report(
    samples: Mapping[str, Sequence[float]], wanted: Sequence[tuple[str, str, str]], control: tuple[str, str, str]
) -> dict[str, Any]:
    """The paired ratios ``wanted`` ((name, numerator side, denominator side), those whose sides
    both ran) and the A/A ``control`` ratio, all per run from ``samples`` (side -> per-run values,
    in the rotation's order, as ``time_generate`` / ``time_updates`` return them). Every ratio's
    summary gets ``vs_control`` when the control's sides ran, against the control oriented like
    the ratio (:func:`oriented_control`; its ``control_order`` says how)."""
    _, c_num, c_den = control
    aa = ratios(samples[c_num], samples[c_den]) if c_num in samples and c_den in samples else None
    report: dict[str, Any] = {"control": None if aa is None else {"name": control[0], **summary(aa)}, "ratios": {}}
    for name, num, den in wanted:
        if num in samples and den in samples:
            r = ratios(samples[num], samples[den])
            report["ratios"][name] = summary(r)
            if aa:
                floor, how = oriented_control(aa, list(samples), (num, den), (c_num, c_den))
                report["ratios"][name]["vs_control"] = versus_control(r, floor) | {"control_order": how}
    return report


def describe(name: str, ratio: Mapping[str, Any], control: Mapping[str, Any] | None) -> str:
    """One line for a ratio: median, IQR, 95 % interval, min-max; the control's; the verdict."""

    def figures(s: Mapping[str, Any]) -> str:
        return (
            f"median {s['median']:.3f} (IQR {s['iqr'][0]:.3f}-{s['iqr'][1]:.3f}, 95% CI "
            f"{s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}, min-max {s['min']:.3f}-{s['max']:.3f}, {s['n']} runs)"
        )

    line = f"{name}: {figures(ratio)}"
    if control is None or "vs_control" not in ratio:
        return line
    vs = ratio["vs_control"]
    verdict = "distinguishable from" if vs["distinguishable"] else "NOT distinguishable from"
    how = {"same": "", "inverted": ", taken inverted for this ratio's order", "unmatched": ", order not matched"}
    return (
        f"{line}\n    A/A control {control['name']}: {figures(control)}\n    difference of medians "
        f"{vs['median_difference']:+.3f} (95% CI {vs['ci95'][0]:+.3f} to {vs['ci95'][1]:+.3f}"
        f"{how.get(vs.get('control_order', 'same'), '')}): {verdict} noise"
    )
