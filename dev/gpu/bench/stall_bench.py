"""The stall a weight update causes to generation in flight (issue 29 part 3), through rlinfer's facade.

``--concurrency`` streaming requests run all the time (long ``max_tokens``, ignore_eos, each
re-submitted when it ends; arrival times of every delta are kept). Time is cut into phases,
``--rounds`` times ``A B`` per mode:

* A (undisturbed, ``--phase-s``): tokens/s and the inter-token gaps (p50, p99, max);
* B (the same, plus a weight update every ``--every-s`` seconds): per update the **stall** (the
  longest inter-token gap that overlaps the update, and its excess over A's p50 gap: what the
  update added to an ordinary step), the update's duration, and the tokens/s inside the window
  while the update (or the staging) runs, as a ratio to the paired A's tokens/s.

Where the engine core reports when it loaded (vLLM's step-boundary loads, engine clock), each
update also gets the **boundary gap**: the gap between the last step output before the load and
the first after it, less A's p50 gap (``boundary_excess_ms``): what the load itself added, free of
the ordinary long steps that a long window also overlaps (``placebo_boundary_excess_ms``: the gap
at the same instant of A; ``a_step_gaps_ms``: the gap at 50 instants of each A).

Noise floor: each A is also measured at the same offsets and window lengths as its B's updates
(``placebo``: the stall and window ratio of nothing), and the A phases' spread is reported.

Modes: ``update`` (``await engine.update_weights(...)``: window = stall window = the call) and
``staged`` (``handle = await engine.stage_weights(...)`` while generating, then ``await
handle.commit()``: window = the staging, stall = gaps over the commit); staged runs only where
the engine claims ``weights.staged``, else it is reported as not claimed. The update is the
model's own weights and the same plus 1e-3 noise, alternately (a full-size, real change), as
NamedTensors on the engine's device (CUDA tensors go by CUDA IPC; CPU tensors on CPU).

Clocks (``--clock``): ``client`` times every delta where this process reads it (the streams are
the load; at 128 streams the bench process itself saturates a core, which bounds what it can
resolve); ``engine`` (vLLM in-process only) keeps the load as plain ``generate`` calls and times
the engine's steps instead: the engine core stamps each step's output batch
(``EngineCoreOutputs.timestamp``, ``time.monotonic`` in the engine-core process, the clock of
``time.perf_counter`` here on Linux) and the bench reads those stamps and the tokens of each batch
as they reach the engine client. A gap between two stamps is one engine step, or the update that
ran between two steps: that gap is the stall, independent of how fast this process reads.

    python3 dev/gpu/bench/stall_bench.py --backend vllm --model $RLINFER_GPU_MODEL --json-out stall-vllm.json
    python3 dev/gpu/bench/stall_bench.py --backend vllm --model $RLINFER_GPU_MODEL --clock engine \\
        --json-out stall-vllm-engine-clock.json
    python3 dev/gpu/bench/stall_bench.py --backend vllm --device cpu --concurrency 8 --phase-s 10 \\
        --every-s 3 --json-out stall-vllm-cpu.json      # a tiny random model: checks the script only

Writes one JSON document; exits 1 if anything failed (the error is in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import gc
import itertools
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
import traceback
from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync_bench import GB, load_weight_sets

STAGED = "weights.staged"
GOAL = {"stall_excess_ms_max": 5.0, "window_ratio_min": 0.95, "weights_gb": 1.26}


class Load:
    """``concurrency`` streams kept running; ``times[r]``/``counts[r]``: request r's delta arrivals."""

    def __init__(self, engine: Any, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        self.vocab = engine.model_info.vocab_size if engine.model_info else 256
        self.times: list[array[float]] = []
        self.counts: list[array[int]] = []
        self.errors: list[str] = []
        #: (start, seconds) of this process's garbage collections: a long one stalls every stream here
        self.gc_pauses: list[tuple[float, float]] = []
        self._submitted = itertools.count()
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)
        self._stop = False
        if args.clock == "engine":
            self.times.append(array("d"))
            self.counts.append(array("I"))
            attach_engine_clock(engine, self.times[0], self.counts[0])
        self._tasks = [asyncio.create_task(self._slot(i)) for i in range(args.concurrency)]

    async def _slot(self, slot: int) -> None:
        from rlinfer_core.types import GenerateRequest, SamplingParams

        # staggered lengths, so that requests end (and prefill anew) at different times
        max_tokens = self.args.max_tokens // 2 + slot * self.args.max_tokens // (2 * self.args.concurrency)
        sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        while not self._stop:
            k = next(self._submitted)
            prompt = [(97 * k + 31 * j) % (self.vocab - 16) + 16 for j in range(self.args.prompt_len)]
            request = GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            if self.args.clock == "engine":  # the engine's step stamps are the record
                try:
                    await self.engine.generate([request])
                except Exception as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.1)
                continue
            times, counts = array("d"), array("I")
            self.times.append(times)
            self.counts.append(counts)
            try:
                async for delta in self.engine.stream(request):
                    if delta.token_ids:
                        times.append(time.perf_counter())
                        counts.append(len(delta.token_ids))
            except Exception as exc:  # recorded; the load goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.1)

    def _on_gc(self, phase: str, _info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_started = now
        else:
            self.gc_pauses.append((self._gc_started, now - self._gc_started))

    def gc_ms(self, t0: float, t1: float) -> dict[str, float]:
        """Garbage-collection time (ms) in [t0, t1): total and the longest pause."""
        inside = [max(0.0, min(s + d, t1) - max(s, t0)) for s, d in self.gc_pauses if s < t1 and s + d > t0]
        return {"total": sum(inside) * 1e3, "longest": max(inside, default=0.0) * 1e3}

    async def stop(self) -> None:
        """Stop re-submitting, abort what is in flight, wait for the streams to end."""
        from rlinfer_core.types import Capability

        self._stop = True
        gc.callbacks.remove(self._on_gc)
        if self.engine.capabilities.supports(Capability.ABORT):
            await self.engine.abort()
        _, pending = await asyncio.wait(self._tasks, timeout=60)
        for task in pending:
            task.cancel()


def attach_engine_clock(engine: Any, times: array[float], counts: array[int]) -> None:
    """Record each engine step of a vLLM in-process engine: the engine core's stamp of its output
    batch and the batch's new tokens (see the module docstring). Reaches into the backend's
    transport (a bench probe, not rlinfer's API); fails loudly where that is not vLLM in-process."""
    llm = getattr(getattr(getattr(engine, "_backend", None), "_transport", None), "_llm", None)
    core = getattr(llm, "engine_core", None)
    if core is None or not hasattr(core, "get_output_async"):
        raise RuntimeError("--clock engine needs the vLLM backend in process (AsyncLLM's engine-core client)")
    receive = core.get_output_async

    async def stamped() -> Any:
        outputs = await receive()
        tokens = sum(len(o.new_token_ids) for o in outputs.outputs)
        if tokens:
            times.append(outputs.timestamp)
            counts.append(tokens)
        return outputs

    core.get_output_async = stamped  # AsyncLLM's output loop looks the method up on every step


def _gaps(times: array[float], lo: int, hi: int) -> list[float]:
    return [times[i] - times[i - 1] for i in range(max(lo, 1), hi)]


def phase_stats(load: Load, t0: float, t1: float) -> dict[str, Any]:
    """Tokens/s in [t0, t1), the gaps that end in it (ms: p50, p99, max; where the longest ended,
    in seconds from t0) and the bench process's garbage-collection time in it."""
    import numpy as np

    gaps: list[float] = []
    tokens, longest, longest_end = 0, 0.0, t0
    for times, counts in zip(load.times, load.counts, strict=True):
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_left(times, t1)
        tokens += sum(counts[lo:hi])
        mine = _gaps(times, lo, hi)
        if mine and max(mine) > longest:
            longest = max(mine)
            longest_end = times[max(lo, 1) + mine.index(longest)]
        gaps += mine
    ms = np.array(gaps) * 1e3 if gaps else np.zeros(1)
    return {
        "seconds": t1 - t0,
        "tok_s": tokens / (t1 - t0),
        "gaps": len(gaps),
        "gap_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "max": float(ms.max())},
        "longest_gap_end_s": longest_end - t0,
        "gc_ms": load.gc_ms(t0, t1),
    }


def window_tokens(load: Load, u0: float, u1: float) -> int:
    """Tokens that arrived in [u0, u1)."""
    return sum(
        sum(c[bisect.bisect_left(t, u0) : bisect.bisect_left(t, u1)])
        for t, c in zip(load.times, load.counts, strict=True)
    )


def stall(load: Load, u0: float, u1: float) -> dict[str, float]:
    """The longest gap (ms) that overlaps [u0, u1] (it began before u1 and ended after u0), how
    many requests had such a gap (in flight across the window), and the GC time (ms) in it."""
    worst, affected = 0.0, 0
    for times in load.times:
        lo, hi = bisect.bisect_right(times, u0), min(bisect.bisect_left(times, u1), len(times) - 1)
        gaps = _gaps(times, lo, hi + 1)
        if gaps:
            worst, affected = max(worst, max(gaps)), affected + 1
    return {"stall_ms": worst * 1e3, "requests": affected, "gc_ms": load.gc_ms(u0, u1)["total"]}


class BoundaryTimings(logging.Handler):
    """vLLM's loads at the engine core's step boundary (rlinfer_vllm.engine_core.step_boundary), as
    the backend logs them at DEBUG: how long the load waited for the step in flight
    (``step_wait_s``), took with the cache handling (``boundary_load_s``), when on the engine
    core's clock (``load_start_t``, ``load_end_t``), and whether it reset the prefix cache; other
    backends log none."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.rows: list[dict[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the dict argument of a step-boundary record (logging makes a lone dict the args)."""
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        self.rows.extend(dict(a) for a in args if isinstance(a, Mapping) and "boundary_load_s" in a)


BOUNDARY = BoundaryTimings()


async def apply_update(engine: Any, mode: str, weights: Any) -> dict[str, float]:
    """One update; its window (throughput) and stall window as perf_counter times, and the
    engine core's step-boundary timings where the backend logged them."""
    seen = len(BOUNDARY.rows)
    t0 = time.perf_counter()
    if mode == "update":
        await engine.update_weights(weights)
        t1 = time.perf_counter()
        event = {"t0": t0, "t1": t1, "s0": t0, "s1": t1, "update_s": t1 - t0}
    else:
        handle = await engine.stage_weights(weights)
        t1 = time.perf_counter()
        await handle.commit()
        t2 = time.perf_counter()
        event = {"t0": t0, "t1": t1, "s0": t1, "s1": t2, "stage_s": t1 - t0, "update_s": t2 - t1}
    for row in BOUNDARY.rows[seen:]:
        event |= {k: float(v) for k, v in row.items() if k.endswith(("_s", "_t"))}
        event["prefix_cache_reset"] = float(row.get("prefix_cache_reset", 0.0))
    return event


async def phase_b(
    engine: Any, args: argparse.Namespace, mode: str, sets: Iterator[Any]
) -> tuple[float, float, list[dict[str, float]]]:
    """T seconds with an update every N seconds (the first at N/2, none in the last N/2); ``sets``
    alternates the weight sets across phases, so that every update changes the weights."""
    from rlinfer_core.weights import NamedTensors

    start, events = time.perf_counter(), []
    due = start + args.every_s / 2
    while due <= start + args.phase_s - args.every_s / 2:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        events.append(await apply_update(engine, mode, NamedTensors.of(next(sets))))
        due += args.every_s
    await asyncio.sleep(max(0.0, start + args.phase_s - time.perf_counter()))
    return start, time.perf_counter(), events


def windows_ratio(load: Load, windows: list[tuple[float, float]], reference_tok_s: float) -> float:
    """Tokens/s over all windows together, relative to ``reference_tok_s``."""
    seconds = sum(u1 - u0 for u0, u1 in windows)
    return sum(window_tokens(load, u0, u1) for u0, u1 in windows) / seconds / reference_tok_s


def boundary_gap(load: Load, t0: float, t1: float) -> float | None:
    """The gap (ms) between the engine's last step output before ``t0`` and its first after
    ``t1`` (engine clock only: one series of step stamps): the step boundary a load held."""
    if len(load.times) != 1:
        return None
    times = load.times[0]
    after = bisect.bisect_left(times, t1)
    before = bisect.bisect_right(times, t0) - 1
    if before < 0 or after >= len(times):
        return None
    return (times[after] - times[before]) * 1e3


def analyse_round(
    load: Load, a: tuple[float, float], b: tuple[float, float], events: list[dict[str, float]]
) -> dict[str, Any]:
    """One A B pair: both phases, each update's stall and window, and the placebo in A."""
    sa, sb = phase_stats(load, *a), phase_stats(load, *b)
    step_ms = sa["gap_ms"]["p50"]
    updates, placebo = [], []
    for e in events:
        s = stall(load, e["s0"], e["s1"])
        timings = {k: v for k, v in e.items() if k.endswith("_s") or k == "prefix_cache_reset"}
        updates.append(timings | s | {"excess_ms": s["stall_ms"] - step_ms})
        p0 = a[0] + (e["s0"] - b[0])  # the same offset and length in A
        placebo.append(stall(load, p0, p0 + e["s1"] - e["s0"])["stall_ms"] - step_ms)
        if "load_start_t" in e:  # the gap around the load itself, and the gap at the same instant of A
            gap = boundary_gap(load, e["load_start_t"], e["load_end_t"])
            q0 = a[0] + (e["load_start_t"] - b[0])
            calm = boundary_gap(load, q0, q0)
            if gap is not None and calm is not None:
                updates[-1] |= {
                    "boundary_gap_ms": gap,
                    "boundary_excess_ms": gap - step_ms,
                    "placebo_boundary_excess_ms": calm - step_ms,
                }
    windows = [(e["t0"], e["t1"]) for e in events]
    shifted = [(a[0] + u0 - b[0], a[0] + u1 - b[0]) for u0, u1 in windows]
    return {
        "a": sa,
        "b": sb,
        "updates": updates,
        "b_over_a": sb["tok_s"] / sa["tok_s"],
        "window_ratio": windows_ratio(load, windows, sa["tok_s"]) if windows else None,
        "placebo": {"excess_ms": placebo, "window_ratio": windows_ratio(load, shifted, sa["tok_s"])},
        "a_step_gaps_ms": sampled_step_gaps(load, *a),
    }


def sampled_step_gaps(load: Load, t0: float, t1: float, n: int = 50) -> dict[str, float] | None:
    """The step gap at ``n`` evenly spaced instants of [t0, t1) (engine clock only): how long a
    gap an instant of an undisturbed phase falls into, which a long step weights by its length."""
    import numpy as np

    gaps = [boundary_gap(load, t, t) for t in np.linspace(t0, t1, n, endpoint=False)]
    ms = np.array([g for g in gaps if g is not None])
    if not ms.size:
        return None
    return {"p50": float(np.median(ms)), "p90": float(np.percentile(ms, 90)), "max": float(ms.max()), "n": int(ms.size)}


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max, n."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(rounds: list[dict[str, Any]], on_gpu: bool) -> dict[str, Any]:
    """Medians and spread over rounds and updates; the H100 goal judged only on a GPU."""
    ups = [u for r in rounds for u in r["updates"]]
    a_tok = [r["a"]["tok_s"] for r in rounds]
    out: dict[str, Any] = {
        "stall_ms": spread([u["stall_ms"] for u in ups]),
        "stall_excess_ms": spread([u["excess_ms"] for u in ups]),
        "placebo_excess_ms": spread([p for r in rounds for p in r["placebo"]["excess_ms"]]),
        "update_ms": spread([u["update_s"] * 1e3 for u in ups]),
        "window_ratio": spread([r["window_ratio"] for r in rounds]),
        "placebo_window_ratio": spread([r["placebo"]["window_ratio"] for r in rounds]),
        "b_over_a": spread([r["b_over_a"] for r in rounds]),
        "a_tok_s": spread(a_tok),
        "a_over_median_a": spread([t / statistics.median(a_tok) for t in a_tok]),
        "a_gap_p99_ms": spread([r["a"]["gap_ms"]["p99"] for r in rounds]),
    }
    if "stage_s" in ups[0]:
        out["stage_ms"] = spread([u["stage_s"] * 1e3 for u in ups])
    at_boundary = [u for u in ups if "boundary_excess_ms" in u]
    if at_boundary:  # the step gap that held the load, against the same instant of an undisturbed phase
        out["boundary_excess_ms"] = spread([u["boundary_excess_ms"] for u in at_boundary])
        out["placebo_boundary_excess_ms"] = spread([u["placebo_boundary_excess_ms"] for u in at_boundary])
    if on_gpu:
        out["goal_met"] = {
            "stall": out["stall_excess_ms"]["max"] <= GOAL["stall_excess_ms_max"],
            "throughput": out["window_ratio"]["median"] >= GOAL["window_ratio_min"],
        }
    return out


def engine_config(args: argparse.Namespace, model: Path) -> Any:
    """bf16 and a fixed memory share on cuda, float32 and a small KV budget on cpu; then --set."""
    from rlinfer_core.types import EngineConfig, parse_assignments

    on_gpu = args.device == "cuda"
    fields: dict[str, Any] = {
        "model": str(model),
        "seed": 0,
        "device": args.device,
        "dtype": "bfloat16" if on_gpu else "float32",
        "max_num_seqs": args.concurrency,
        "max_model_len": 2048 if on_gpu else 512,
        "startup_timeout_s": 420.0,
        "request_timeout_s": 600.0,
        "engine_kwargs": parse_assignments(args.engine_arg),
    }
    fields |= {"gpu_memory_utilization": 0.5} if on_gpu else {"kv_cache_memory_bytes": 64 << 20}
    fields.update(parse_assignments(args.set, "--set"))
    return EngineConfig(**fields)


def versions(engine: Any) -> dict[str, str]:
    """The engine's and rlinfer's versions."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"engine": engine.capabilities.engine_version}
    for dist in ("rlinfer-core", f"rlinfer-{engine.backend_name}"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed as a distribution"
    return out


async def measure(engine: Any, args: argparse.Namespace, model: Path, result: dict[str, Any]) -> None:
    """Load on, warm up, then A B per mode and round; the analysis into ``result``."""
    from rlinfer_core.weights import NamedTensors

    claimed = {c.value for c in engine.capabilities.supported}
    modes = [m for m in args.modes if m != "staged" or STAGED in claimed]
    result["modes"] = {
        m: {"not_claimed": engine.capabilities.notes.get(STAGED, "")} for m in args.modes if m not in modes
    }
    a, b, nbytes = load_weight_sets(engine, model, seed=1, device=args.device)
    result["weights"] = {"tensors": len(a), "gb": nbytes / GB, "device": args.device}
    sets = itertools.cycle([b, a])
    load = Load(engine, args)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    failed: dict[str, str] = {}  # a mode whose update raised runs no more rounds; the others go on
    warmup: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    await asyncio.sleep(args.warmup_s / 2)
    for mode in modes:  # two updates per mode under load, outside the phases: the first ones are slow
        try:
            for _ in range(2):
                event = await apply_update(engine, mode, NamedTensors.of(next(sets)))
                warmup[mode].append({k: v for k, v in event.items() if k.endswith("_s")})
        except Exception as exc:
            failed[mode] = f"{mode}: {type(exc).__name__}: {exc}"
    result["warmup_updates"] = warmup
    await asyncio.sleep(args.warmup_s / 2)
    plan: dict[str, list[tuple[tuple[float, float], tuple[float, float], list[dict[str, float]]]]] = {
        m: [] for m in modes
    }
    for _ in range(args.rounds):
        for mode in (m for m in modes if m not in failed):
            t0 = time.perf_counter()
            await asyncio.sleep(args.phase_s)
            phase_a = (t0, time.perf_counter())
            try:
                b0, b1, events = await phase_b(engine, args, mode, sets)
            except Exception as exc:
                failed[mode] = f"{mode}: {type(exc).__name__}: {exc}"
                continue
            plan[mode].append((phase_a, (b0, b1), events))
    # near 1.0: the bench's own event loop (streams, the engine's output handling) is saturated
    result["bench_process_cpu_fraction"] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    await load.stop()
    result["requests"] = next(load._submitted)
    result["load_errors"] = {"count": len(load.errors), "first": load.errors[:5]}
    result["errors"] += list(failed.values())
    for mode, rounds in plan.items():
        analysed = [analyse_round(load, pa, pb, ev) for pa, pb, ev in rounds]
        summary = summarise(analysed, args.device == "cuda") if analysed else {}
        result["modes"][mode] = {"rounds": analysed, "summary": summary, "error": failed.get(mode)}


async def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Start the engine (a tiny random model on cpu unless --model), measure, shut down."""
    import attrs

    from rlinfer_core.engine import AsyncEngine

    model = args.model
    if model is None:
        from rlinfer_core.tiny_model import make_tiny_model

        model = make_tiny_model(Path(tempfile.mkdtemp(prefix="stall-")) / "model", seed=0)
    config = engine_config(args, model)
    result["config"] = json.loads(json.dumps(attrs.asdict(config), default=str))
    backend_log = logging.getLogger(f"rlinfer_{args.backend}.backend")
    backend_log.setLevel(logging.DEBUG)  # the step-boundary timings (BoundaryTimings)
    backend_log.addHandler(BOUNDARY)
    engine = await AsyncEngine.open(args.backend, config, load_entry_point_plugins=False)
    try:
        result["versions"] = versions(engine)
        await measure(engine, args, model, result)
    finally:
        await engine.shutdown()


def summary_text(result: dict[str, Any]) -> str:
    """One line per mode."""
    gb, cpu = result.get("weights", {}).get("gb", 0), result.get("bench_process_cpu_fraction", 0)
    lines = [f"stall bench, {result['backend']} on {result.get('device')} ({gb:.3f} GB; bench process CPU {cpu:.2f})"]
    for mode, m in result.get("modes", {}).items():
        if not m.get("summary"):
            lines.append(f"  {mode}: " + (m.get("error") or f"not claimed ({m.get('not_claimed') or 'no reason'})"))
            continue
        s = m["summary"]
        staging = f" (staging {s['stage_ms']['median']:.1f} ms)" if "stage_ms" in s else ""
        lines.append(
            f"  {mode}: stall {s['stall_ms']['median']:.1f} ms median, {s['stall_ms']['max']:.1f} max; excess over "
            f"a step {s['stall_excess_ms']['median']:.1f} / {s['stall_excess_ms']['max']:.1f} ms (placebo "
            f"{s['placebo_excess_ms']['median']:.1f} / {s['placebo_excess_ms']['max']:.1f}); update "
            f"{s['update_ms']['median']:.1f} ms{staging}; window ratio {s['window_ratio']['median']:.3f} "
            f"({s['window_ratio']['min']:.3f}-{s['window_ratio']['max']:.3f}, placebo "
            f"{s['placebo_window_ratio']['median']:.3f}); B/A {s['b_over_a']['median']:.3f}; "
            f"A spread {s['a_over_median_a']['min']:.3f}-{s['a_over_median_a']['max']:.3f}; goal {s.get('goal_met')}"
        )
    return "\n".join(lines + [f"ERROR {e}" for e in result["errors"]])


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", type=Path, help="HF model dir (default on cpu: a tiny random model)")
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--modes", default="update,staged", help="comma-separated: update, staged")
    parser.add_argument("--concurrency", type=int, default=128, help="requests kept in flight")
    parser.add_argument("--clock", choices=["client", "engine"], default="client", help="see the module docstring")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1024, help="per request: from half this to all of it")
    parser.add_argument("--phase-s", type=float, default=15.0, help="T: seconds per phase")
    parser.add_argument("--every-s", type=float, default=3.0, help="N: seconds between updates in B")
    parser.add_argument("--rounds", type=int, default=3, help="A B pairs per mode")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="engine_kwargs entry")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="EngineConfig field")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    if args.model is None and args.device == "cuda":
        parser.error("--model is needed on cuda (the tiny random model is for --device cpu)")
    result: dict[str, Any] = {
        "bench": "stall",
        "backend": args.backend,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "model": str(args.model or "tiny random Llama (rlinfer_core.tiny_model, seed 0)"),
        "params": {k: v for k, v in vars(args).items() if k not in ("json_out", "model")},
        "goal_on_h100": GOAL,
        "errors": [],
    }
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        result["torch"] = torch.__version__
        asyncio.run(run(args, result))
    except Exception as exc:
        result["errors"].append(f"{type(exc).__name__}: {exc}")
        result["traceback"] = traceback.format_exc()
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=1, default=str))
    print(summary_text(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
