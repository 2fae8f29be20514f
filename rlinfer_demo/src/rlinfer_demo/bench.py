"""``rlinfer bench``: rlinfer's overhead against the raw engine, measured in one run.

The sides take turns on the same batches (:mod:`rlinfer_demo.bench_sides`: the order rotates
from run to run, so drift hits every side alike; ratios are paired per run):

* generate: ``AsyncEngine.generate`` (validation, conversion, version stamping) vs the backend's
  ``rlinfer_bench_raw_generate`` (the engine's native API, no rlinfer types) on the *same engine*;
* weight update: ``update_weights(CheckpointDir)`` and ``update_weights(NamedTensors)`` (with
  rlinfer's all-or-nothing validation) vs the engine's own reload-from-disk call (plus the
  prefix-cache reset that any correct reload needs, as rlinfer's update does).

The engine is the whole :class:`EngineConfig` of ``--config FILE`` / ``--set`` / the flags. Two
more comparisons join the same runs when asked for:

* server mode (``rollout: {mode: server}`` or a ``server_url``): an in-process engine of the same
  config as a third side (``inprocess``), so the HTTP hop is measured against in-process;
* ``--replicas N``: an rlinfer-ray pool of N replicas of the same config (``pool``):
  at N=1 the pool's overhead over the direct engine, at N>=2 the throughput of N replicas over
  one engine, and ``pool_one`` (the same pool routed to replica 0 only: N replicas vs 1 on the
  same engines); weight updates to the N replicas vs the one engine.

Every ratio comes with its noise floor from the same runs: an A/A control, the raw side timed a
second time (``raw_control``, ``raw_disk_control``) right after itself in the rotation, so
raw/raw_control is alternated exactly like rlinfer/raw (:func:`rlinfer_demo.bench_sides.with_control`).
Each paired ratio reports median, IQR, bootstrap 95 % CI and min-max, and ``vs_control``: whether
it is distinguishable from the control (:mod:`rlinfer_demo.bench_stats`).

Needs a backend claiming ``Capability.BENCH`` (the raw-engine baselines). ``--runs`` timed runs
after one warm-up of each side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlinfer_core.engine import AsyncEngine
from rlinfer_core.types import Capability, EngineConfig
from rlinfer_core.weights import CheckpointDir, NamedTensors
from rlinfer_demo.bench_sides import (
    GenerateSide,
    UpdateSide,
    machine_load,
    make_batch,
    spread,
    time_generate,
    time_updates,
    with_control,
)
from rlinfer_demo.bench_stats import describe, paired_report

__all__ = ["bench_config", "main", "make_batch", "run_bench"]

#: paired ratios reported when both sides ran: (name, numerator, denominator)
GENERATE_RATIOS = (
    ("rlinfer/raw", "rlinfer", "raw"),
    ("pool/rlinfer", "pool", "rlinfer"),
    ("pool/pool_one", "pool", "pool_one"),
    ("rlinfer/inprocess", "rlinfer", "inprocess"),
)
UPDATE_RATIOS = (
    ("rlinfer_disk/raw_disk", "rlinfer_disk", "raw_disk"),
    ("pool_tensors/rlinfer_tensors", "pool_tensors", "rlinfer_tensors"),
    ("pool_disk/rlinfer_disk", "pool_disk", "rlinfer_disk"),
    ("rlinfer_tensors/inprocess_tensors", "rlinfer_tensors", "inprocess_tensors"),
)
#: the A/A controls (the noise floor of every ratio above): the raw side against itself
GENERATE_CONTROL = ("raw/raw_control", "raw", "raw_control")
UPDATE_CONTROL = ("raw_disk/raw_disk_control", "raw_disk", "raw_disk_control")


def bench_config(args: argparse.Namespace, workdir: Path) -> tuple[str, EngineConfig, bool]:
    """The backend and the engine's whole EngineConfig: defaults (seed 0, a tiny random model made
    in ``workdir`` when none is named), then ``--config``, then ``--set``, then the flags
    (``--model``, ``--dtype``, ``--engine-arg``); and whether the model was named."""
    from rlinfer_core.cli import backend_name, config_layers
    from rlinfer_core.config_file import engine_config
    from rlinfer_core.types import parse_assignments

    settings, overrides = config_layers(args, {"model": getattr(args, "model", None), "dtype": args.dtype})
    backend = backend_name(args, settings)
    engine_args = parse_assignments(getattr(args, "engine_arg", []) or [])
    if engine_args:
        overrides["engine_kwargs"] = {**dict(overrides.get("engine_kwargs") or {}), **engine_args}
    named = overrides.get("model") or (settings.fields.get("model") if settings else None)
    if named:
        model = str(named)
    else:
        from rlinfer_core.tiny_model import make_tiny_model

        model = str(make_tiny_model(workdir / "model-a", seed=0))
    return backend, engine_config(settings, overrides, defaults={"model": model, "seed": 0}), bool(named)


def _engine_tensors(engine: Any, model_dir: Path) -> list[tuple[str, Any]]:
    """The checkpoint's tensors that the engine accepts, cast to the engine's dtypes."""
    from rlinfer_core.transfer.buckets import to_dtype
    from rlinfer_core.transfer.disk import read_tensors

    specs = engine.weight_specs
    return [(n, t.to(to_dtype(specs[n].dtype))) for n, t in read_tensors(model_dir) if n in specs]


def _tokens(engine: Any) -> GenerateSide:
    async def run(batch: list[Any]) -> int:
        return sum(len(c.token_ids) for c in await engine.generate(batch))

    return run


def _updater(engine: Any, sources: list[Any]) -> UpdateSide:
    async def run(which: int) -> None:
        await engine.update_weights(sources[which])

    return run


def _raw_reloader(engine: Any, paths: list[str]) -> UpdateSide:
    async def run(which: int) -> None:
        await engine.bench_raw_weight_update(paths[which])
        if engine.capabilities.supports(Capability.PREFIX_CACHE_RESET):
            await engine.reset_prefix_cache()

    return run


def bench_pool_config(args: argparse.Namespace, replicas: int) -> Any:
    """The pool of ``--replicas N``: the ``--config`` file's ``pool:`` section (routing, CPUs,
    Ray address, ...) with ``replicas`` on top (rlinfer_ray.config_file)."""
    from rlinfer_core.config_file import read_config_file
    from rlinfer_core.errors import InvalidRequest

    try:
        from rlinfer_ray.config_file import pool_config
    except ModuleNotFoundError as exc:
        if exc.name not in ("rlinfer_ray", "rlinfer_ray.config_file", "ray"):
            raise
        raise InvalidRequest("replicas", f"--replicas needs rlinfer-ray installed ({exc})") from None
    settings = read_config_file(args.config) if getattr(args, "config", None) else None
    return pool_config(settings, {"replicas": replicas})


async def _open_pool(backend: str, config: EngineConfig, pool_config: Any) -> Any:
    from rlinfer_ray import open_async_pool

    return await open_async_pool(backend, config, pool=pool_config, load_entry_point_plugins=False)


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result."""
    workdir = Path(tempfile.mkdtemp(prefix="rlinfer-bench-"))
    backend, config, named = bench_config(args, workdir)
    replicas = getattr(args, "replicas", None)
    pool_settings = bench_pool_config(args, replicas) if replicas else None
    load_before = machine_load()
    opened: dict[str, Any] = {}
    open_s: dict[str, float] = {}

    async def open_side(name: str, opening: Any) -> Any:
        started = time.perf_counter()
        opened[name] = await opening
        open_s[name] = time.perf_counter() - started
        return opened[name]

    try:
        engine = await open_side("engine", AsyncEngine.open(backend, config, load_entry_point_plugins=False))
        engine.capabilities.require(Capability.BENCH)
        gen_sides = with_control({"rlinfer": _tokens(engine), "raw": engine.bench_raw_generate}, "raw")
        inproc = pool = None
        if config.server_mode:
            import attrs

            twin = attrs.evolve(config, mode="inprocess", server_url=None)
            inproc = await open_side("inprocess", AsyncEngine.open(backend, twin, load_entry_point_plugins=False))
            gen_sides["inprocess"] = _tokens(inproc)
        if replicas:
            pool = await open_side("pool", _open_pool(backend, config, pool_settings))
            gen_sides["pool"] = _tokens(pool)
            if replicas > 1:
                from rlinfer_ray import pool_backend

                async def one_replica(batch: list[Any]) -> int:
                    with pool_backend(pool).routed_to([0]):
                        return sum(len(c.token_ids) for c in await pool.generate(batch))

                gen_sides["pool_one"] = one_replica
        assert engine.model_info is not None
        vocab = engine.model_info.vocab_size
        runs = max(1, args.runs)
        gen, tokens = await time_generate(
            gen_sides,
            lambda run: make_batch(f"r{run}", args.prompts, args.prompt_len, args.max_tokens, vocab, seed=run + 1),
            runs,
        )

        # Weight updates: alternate between two checkpoints so every update really changes weights.
        model = Path(config.model)
        if named:
            from rlinfer_core.transfer.disk import save_dir

            second = save_dir(_engine_tensors(engine, model), workdir / "model-b")
        else:
            from rlinfer_core.tiny_model import make_tiny_model

            second = make_tiny_model(workdir / "model-b", seed=1)
        dirs = [model, second]
        tensors = [_engine_tensors(engine, d) for d in dirs]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors[0])
        disk = [CheckpointDir(str(d)) for d in dirs]
        named_tensors = [NamedTensors(tuple(t)) for t in tensors]
        upd_sides: dict[str, UpdateSide] = {}
        for name, target in (("rlinfer", engine), ("inprocess", inproc), ("pool", pool)):
            if target is None:
                continue
            if name != "inprocess":
                upd_sides[f"{name}_disk"] = _updater(target, disk)
            if name == "rlinfer":
                upd_sides["raw_disk"] = _raw_reloader(engine, [str(d) for d in dirs])
            upd_sides[f"{name}_tensors"] = _updater(target, named_tensors)
        upd = await time_updates(with_control(upd_sides, "raw_disk"), runs)
        caps = engine.capabilities
        served = None
        if pool is not None:
            from rlinfer_ray import pool_backend

            served = [r.served for r in pool_backend(pool).replicas.replicas]
    finally:
        for side in reversed(list(opened.values())):
            with contextlib.suppress(Exception):
                await side.shutdown()

    return _result(args, backend, config, named, runs, caps, gen, tokens, upd, nbytes) | {
        "replicas": replicas,
        "pool": None if not replicas else {"replicas": replicas, "served_per_replica": served},
        "open_s": open_s,
        "load": {"before": load_before, "after": machine_load()},
    }


def _result(
    args: argparse.Namespace,
    backend: str,
    config: EngineConfig,
    named: bool,
    runs: int,
    caps: Any,
    gen: dict[str, list[float]],
    tokens: dict[str, int],
    upd: dict[str, list[float]],
    nbytes: int,
) -> dict[str, Any]:
    import attrs

    med = {k: statistics.median(v) for k, v in gen.items()}
    umed = {k: statistics.median(v) for k, v in upd.items()}
    gen_paired = paired_report(gen, GENERATE_RATIOS, GENERATE_CONTROL)
    upd_paired = paired_report(upd, UPDATE_RATIOS, UPDATE_CONTROL)
    return {
        "backend": backend,
        "engine_version": caps.engine_version,
        "platform": caps.platform,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["rlinfer", *sys.argv[1:]]),
        "model": config.model if named else "tiny random Llama (rlinfer_core.tiny_model, seed 0)",
        "config": json.loads(json.dumps(attrs.asdict(config), default=str)),
        "batch": {"prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "runs": runs,
        "generate": {
            "tokens_per_run": tokens,
            "tok_per_s_samples": gen,
            "tok_per_s_median": med,
            "tok_per_s_spread": {k: spread(v) for k, v in gen.items()},
            "ratio_rlinfer_over_raw": med["rlinfer"] / med["raw"],
            # both sides of a run share its batch and run back to back: robust to slow phases
            "ratio_paired_median": statistics.median(a / b for a, b in zip(gen["rlinfer"], gen["raw"], strict=True)),
            # per-run ratios (median, IQR, ci95, min/max, vs_control) and their A/A noise floor
            "paired": gen_paired["ratios"],
            "control": gen_paired["control"],
        },
        "weight_update": {
            "bytes": nbytes,
            "seconds_samples": upd,
            "seconds_median": umed,
            "seconds_spread": {k: spread(v) for k, v in upd.items()},
            "ratio_raw_disk_over_rlinfer_disk": umed["raw_disk"] / umed["rlinfer_disk"],
            "ratio_raw_disk_over_rlinfer_tensors": umed["raw_disk"] / umed["rlinfer_tensors"],
            "paired": upd_paired["ratios"],
            "control": upd_paired["control"],
        },
    }


def main(args: argparse.Namespace) -> int:
    """Entry of ``rlinfer bench``: print a table and the ratios; write JSON if asked."""
    from rich.console import Console
    from rich.table import Table

    result = asyncio.run(run_bench(args))
    console = Console()
    g, w = result["generate"], result["weight_update"]
    table = Table(title=f"rlinfer bench: {result['backend']} {result['engine_version']} on {result['platform']}")
    table.add_column("measure")
    table.add_column("median", justify="right")
    table.add_column("min-max", justify="right")
    for side, s in g["tok_per_s_spread"].items():
        table.add_row(f"generate tok/s: {side}", f"{s['median']:.0f}", f"{s['min']:.0f}-{s['max']:.0f}")
    for side, s in w["seconds_spread"].items():
        table.add_row(f"weight update s: {side}", f"{s['median']:.4f}", f"{s['min']:.4f}-{s['max']:.4f}")
    console.print(table)
    print(
        f"generate throughput ratio rlinfer/raw = {g['ratio_rlinfer_over_raw']:.3f} "
        f"(median of per-run ratios {g['ratio_paired_median']:.3f}); "
        f"raw disk reload / rlinfer disk update = {w['ratio_raw_disk_over_rlinfer_disk']:.3f}"
    )
    for part, kind in ((g, "tok/s"), (w, "seconds")):
        for name, p in part["paired"].items():
            print(f"paired {kind} ratio {describe(name, p, part['control'])}")
    print(f"machine: {result['load']['before']['cpus']} CPUs, load before/after {result['load']}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json_out}")
    return 0
