"""1 replica vs N replicas of an rlinfer-ray pool: generate throughput and weight-sync time.

On a machine with N GPUs (``nvidia-h200-x2`` for N=2), each replica one GPU
(``tensor_parallel_size=1``), the phases run one after the other (each needs the GPUs):

* ``poolN``: a pool of N replicas. Generate alternates, on the same batches, between the whole
  pool (``pool``) and the same pool routed to replica 0 only (``one_replica``): the paired
  scaling ratio, free of start-to-start variance, with its A/A control from the same runs
  (``one_replica`` timed again right after itself, ``one_replica_control``: its median, spread and
  whether the scaling ratio is distinguishable from it; rlinfer_demo.bench_stats). Weight updates
  to the N replicas.
* ``pool1``: a pool of one replica: the same generate and weight updates (sync to N replicas vs 1).
* ``engine``: the engine alone, no Ray (the pool's overhead at N=1, unpaired).

Weight updates alternate two weight sets (the checkpoint A, and B = A + 1e-3 noise) so that every
update changes the weights; transports: ``tensors`` (the trainer's tensors, put once into Ray's
object store and read by every replica), ``disk`` (a checkpoint directory every replica reloads)
and, with ``--broadcast``, one NCCL group from the trainer to every replica's workers (the
trainer needs a GPU of its own: GPUs 0..N-1 go to Ray, GPU N to the trainer, so N+1 GPUs).

The JSON is rewritten after each phase, so a run cut short still reports what finished; exit 1
when a phase failed (its error is in the JSON).

    source dev/gpu/env.sh vllm        # plus Ray on PYTHONPATH (docs/fleet.md: "On the GPU")
    python3 dev/gpu/bench/pool_scaling_bench.py --backend vllm --model /tmp/rlinfer_model \\
        --json-out $OUT/pool-scaling-vllm.json

Needs python3 with the engine, ray and rlinfer_core/rlinfer_<engine>/rlinfer_demo on PYTHONPATH
(this script adds rlinfer_ray/src itself). ``--device cpu`` runs it on CPU engines (a tiny random
model when ``--model`` is left out) to check the script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
for _src in ("rlinfer_ray/src", "rlinfer_demo/src", "rlinfer_core/src"):
    if str(REPO / _src) not in sys.path:
        sys.path.append(str(REPO / _src))


def gpu_names() -> list[str]:
    """Names of the GPUs nvidia-smi lists ([] on a machine without)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def wait_gpus_free(timeout_s: float = 120.0) -> None:
    """Wait until no process but this one holds a GPU (a stopped pool's engines take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        if {int(p) for p in out.split() if p.strip().isdigit()} <= {os.getpid()}:
            return
        time.sleep(2.0)


def weight_sets(model_dir: Path, workdir: Path) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]], Path]:
    """Weights A (the checkpoint) and B (A + 1e-3 noise, also saved as a checkpoint), on the CPU."""
    import torch

    from rlinfer_core.transfer.disk import read_tensors, save_dir

    a = list(read_tensors(model_dir))
    gen = torch.Generator().manual_seed(1)
    b = [(n, t + (1e-3 * torch.randn(t.shape, generator=gen)).to(t.dtype)) for n, t in a]
    return a, b, save_dir(b, workdir / "weights-b")


def engine_config(args: argparse.Namespace, model: Path) -> Any:
    """The engine's EngineConfig: GPU defaults of dev/gpu (bf16, a fixed memory share), then --set."""
    from rlinfer_core.types import EngineConfig, parse_assignments

    fields: dict[str, Any] = {
        "model": str(model),
        "seed": 0,
        "device": args.device,
        "dtype": args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        "startup_timeout_s": args.startup_timeout,
        "request_timeout_s": args.request_timeout,
        "engine_kwargs": parse_assignments(args.engine_arg),
    }
    if args.device == "cuda":
        fields["gpu_memory_utilization"] = args.gpu_memory_utilization
        fields["max_model_len"] = args.max_model_len
    fields.update(parse_assignments(args.set, "--set"))
    return EngineConfig(**fields)


def start_ray(args: argparse.Namespace) -> None:
    """A local Ray instance as the pool starts one (workers at niceness 0), holding GPUs 0..N-1 only
    when the trainer needs GPU N for a broadcast."""
    import ray

    from rlinfer_ray.cluster import WORKER_NICENESS

    extra: dict[str, Any] = {}
    if args.device == "cuda":
        # stated, not left to Ray's detection: the GPUs nvidia-smi lists (N of them for the
        # replicas only when the trainer keeps GPU N for a broadcast)
        extra["num_gpus"] = args.replicas if args.broadcast else len(gpu_names())
    ray.init(
        num_cpus=max(int(args.replicas * args.cpus_per_replica + 0.999), os.cpu_count() or 1),
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
        _system_config={"worker_niceness": WORKER_NICENESS},
        **extra,
    )


class Phase:
    """One engine set-up (a pool of ``replicas``, or ``replicas=0``: the engine alone) measured."""

    def __init__(self, args: argparse.Namespace, config: Any, replicas: int) -> None:
        self.args = args
        self.config = config
        self.replicas = replicas
        self.name = f"pool{replicas}" if replicas else "engine"
        self.answered: dict[str, list[dict[int, float]]] = {}

    async def open(self) -> Any:
        from rlinfer_core.engine import AsyncEngine
        from rlinfer_ray import PoolConfig, open_async_pool

        if not self.replicas:
            return await AsyncEngine.open(self.args.backend, self.config, load_entry_point_plugins=False)
        pool = PoolConfig(
            replicas=self.replicas,
            accelerator="gpu" if self.args.device == "cuda" else "cpu",
            cpus_per_replica=self.args.cpus_per_replica,
        )
        return await open_async_pool(self.args.backend, self.config, pool=pool, load_entry_point_plugins=False)

    async def run(self, sets: tuple[list[Any], list[Any], Path], model: Path) -> dict[str, Any]:
        from rlinfer_demo.bench_sides import make_batch, spread, time_generate, time_updates, with_control
        from rlinfer_demo.bench_stats import paired_report
        from rlinfer_ray import pool_backend

        args = self.args
        started = time.perf_counter()
        target = await self.open()
        out: dict[str, Any] = {"replicas": self.replicas, "open_s": time.perf_counter() - started}
        sender = None
        try:
            vocab = target.model_info.vocab_size

            async def whole(batch: list[Any]) -> int:
                return sum(len(c.token_ids) for c in await target.generate(batch))

            async def one_replica(batch: list[Any]) -> int:
                with pool_backend(target).routed_to([0]):
                    return sum(len(c.token_ids) for c in await target.generate(batch))

            sides = {"pool" if self.replicas else "engine": whole}
            if self.replicas > 1:
                sides = with_control({**sides, "one_replica": one_replica}, "one_replica")
            rates, tokens = await time_generate(
                sides,
                lambda run: make_batch(f"r{run}", args.prompts, args.prompt_len, args.max_tokens, vocab, seed=run + 1),
                args.runs,
            )
            out["generate"] = {
                "tokens_per_run": tokens,
                "tok_per_s": {k: {**spread(v), "samples": v} for k, v in rates.items()},
            }
            if "one_replica" in rates:
                report = paired_report(
                    rates,
                    [("pool/one_replica", "pool", "one_replica")],
                    ("one_replica/one_replica_control", "one_replica", "one_replica_control"),
                )
                out["generate"]["paired_pool_over_one_replica"] = report["ratios"]["pool/one_replica"]
                out["generate"]["control"] = report["control"]
            updates, nbytes, sender = await self._update_sides(target, sets, model)
            seconds = await time_updates(updates, args.sync_runs)
            out["weight_sync"] = {
                "bytes": nbytes,
                "weights_on": args.weights_on,
                "seconds": {k: {**spread(v), "samples": v} for k, v in seconds.items()},
                "gb_per_s_median": {k: nbytes / statistics.median(v) / 1e9 for k, v in seconds.items()},
                # per update (warm-up included): seconds from the fan-out's start until each
                # replica answered (PoolBackend.last_update_fanout_s)
                "replica_answered_s": {k: v for k, v in self.answered.items() if v},
            }
            if self.replicas:
                out["served_per_replica"] = [r.served for r in pool_backend(target).replicas.replicas]
        finally:
            if sender is not None:
                with contextlib.suppress(Exception):
                    sender.close()
            with contextlib.suppress(Exception):
                await target.shutdown()
        return out

    async def _update_sides(self, target: Any, sets: tuple[list[Any], list[Any], Path], model: Path) -> Any:
        from rlinfer_core.transfer.buckets import to_dtype
        from rlinfer_core.weights import CheckpointDir, NamedTensors
        from rlinfer_ray import pool_backend

        args = self.args
        specs = target.weight_specs
        device = f"cuda:{args.replicas if args.broadcast else 0}" if args.weights_on == "cuda" else "cpu"
        on_device = [
            [(n, t.to(device=device, dtype=to_dtype(specs[n].dtype))) for n, t in s if n in specs] for s in sets[:2]
        ]
        nbytes = sum(t.numel() * t.element_size() for _, t in on_device[0])
        tensors = [NamedTensors(tuple(s)) for s in on_device]
        disk = [CheckpointDir(str(model)), CheckpointDir(str(sets[2]))]

        answered = self.answered = {"tensors": [], "disk": []}

        async def by_tensors(which: int) -> None:
            await target.update_weights(tensors[which])
            _sync(device)
            if self.replicas:  # when each replica answered: overlapping loads end together
                answered["tensors"].append(dict(pool_backend(target).last_update_fanout_s))

        async def by_disk(which: int) -> None:
            await target.update_weights(disk[which])
            if self.replicas:
                answered["disk"].append(dict(pool_backend(target).last_update_fanout_s))

        sides: dict[str, Any] = {"tensors": by_tensors, "disk": by_disk}
        sender = None
        if args.broadcast:
            sender = await self._join_broadcast(target, device)

            async def by_broadcast(which: int) -> None:
                pending = asyncio.ensure_future(target.update_weights(sender.source(on_device[which])))
                await asyncio.to_thread(sender.send, on_device[which])
                await pending

            sides["broadcast"] = by_broadcast
        return sides, nbytes, sender

    async def _join_broadcast(self, target: Any, device: str) -> Any:
        from rlinfer_core.transfer.broadcast import WeightBroadcaster, free_port
        from rlinfer_core.weights import BroadcastGroup

        if device.startswith("cuda"):
            import torch

            torch.cuda.set_device(device)
        group = BroadcastGroup(
            "127.0.0.1",
            free_port(),
            world_size=1 + target.broadcast_ranks,
            backend="nccl" if device.startswith("cuda") else "gloo",
            timeout_s=300.0,
        )
        joined = asyncio.ensure_future(target.init_weight_broadcast(group))
        sender = await asyncio.to_thread(WeightBroadcaster, group)
        await joined
        return sender


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def figures(phases: dict[str, Any], n: int) -> dict[str, Any]:
    """The headline ratios from whichever phases finished."""
    out: dict[str, Any] = {}
    many, one, alone = phases.get(f"pool{n}", {}), phases.get("pool1", {}), phases.get("engine", {})

    def tok(phase: dict[str, Any], side: str) -> float | None:
        value = phase.get("generate", {}).get("tok_per_s", {}).get(side, {}).get("median")
        return None if value is None else float(value)

    def sync(phase: dict[str, Any], transport: str) -> float | None:
        value = phase.get("weight_sync", {}).get("seconds", {}).get(transport, {}).get("median")
        return None if value is None else float(value)

    if "paired_pool_over_one_replica" in many.get("generate", {}):
        out[f"scaling_pool{n}_over_one_replica_paired"] = many["generate"]["paired_pool_over_one_replica"]
        out[f"scaling_pool{n}_control_one_replica_paired"] = many["generate"]["control"]
    if tok(many, "pool") and tok(one, "pool"):
        out[f"scaling_pool{n}_over_pool1"] = tok(many, "pool") / tok(one, "pool")  # type: ignore[operator]
    if tok(one, "pool") and tok(alone, "engine"):
        out["overhead_pool1_over_engine"] = tok(one, "pool") / tok(alone, "engine")  # type: ignore[operator]
    for transport in ("tensors", "disk", "broadcast"):
        if sync(many, transport) and sync(one, transport):
            out[f"sync_{transport}_pool{n}_over_pool1"] = sync(many, transport) / sync(one, transport)  # type: ignore[operator]
        if sync(one, transport) and sync(alone, transport):
            out[f"sync_{transport}_pool1_over_engine"] = sync(one, transport) / sync(alone, transport)  # type: ignore[operator]
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase in ``args.phases``; the JSON after each one."""
    import attrs

    from rlinfer_demo.bench_sides import machine_load

    workdir = Path(tempfile.mkdtemp(prefix="pool-scaling-"))
    if args.model is None:
        from rlinfer_core.tiny_model import make_tiny_model

        model = make_tiny_model(workdir / "model", seed=0)
    else:
        model = Path(args.model)
    config = engine_config(args, model)
    gpus = gpu_names()
    if args.device == "cuda" and len(gpus) < args.replicas + (1 if args.broadcast else 0):
        raise SystemExit(f"pool_scaling_bench: needs {args.replicas + int(args.broadcast)} GPUs, found {gpus}")
    result: dict[str, Any] = {
        "bench": "pool_scaling",
        "backend": args.backend,
        "model": str(args.model or "tiny random Llama (rlinfer_core.tiny_model, seed 0)"),
        "device": args.device,
        "gpus": gpus,
        "host": platform.node(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": json.loads(json.dumps(attrs.asdict(config), default=str)),
        "batch": {"prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "runs": args.runs,
        "sync_runs": args.sync_runs,
        "load": {"before": machine_load()},
        "phases": {},
        "errors": [],
    }
    sets = weight_sets(model, workdir)
    start_ray(args)
    for name in args.phases:
        replicas = 0 if name == "engine" else int(name.removeprefix("pool"))
        phase = Phase(args, config, replicas)
        print(f"=== phase {phase.name}", flush=True)
        try:
            result["phases"][phase.name] = await phase.run(sets, model)
        except Exception as exc:
            result["errors"].append({"phase": phase.name, "error": repr(exc), "traceback": traceback.format_exc()})
        if args.device == "cuda":
            import torch

            torch.cuda.empty_cache()  # the phase's trainer-side tensors, before the next engines start
            wait_gpus_free()
        result["figures"] = figures(result["phases"], args.replicas)
        result["load"]["after"] = machine_load()
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2))
        print(json.dumps({"phase": phase.name, "figures": result["figures"]}), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run, print the figures; 1 when a phase failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", type=Path, help="HF model dir (default: a tiny random model)")
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=2, help="N: the pool measured against one replica")
    parser.add_argument("--phases", help="comma-separated, in order (default: poolN,pool1,engine)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5, help="timed generate runs per side")
    parser.add_argument("--sync-runs", type=int, default=5, help="timed weight updates per transport")
    parser.add_argument("--weights-on", choices=["cuda", "cpu"], default="cuda", help="where the trainer's weights are")
    parser.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        help="PoolConfig.cpus_per_replica (the replica's OMP threads; default: 8 on cuda, 1 on cpu)",
    )
    parser.add_argument("--broadcast", action="store_true", help="also one NCCL broadcast group (N+1 GPUs)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--max-model-len", type=int, default=2048, help="on cuda (cpu: the model's own)")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="engine_kwargs entry")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="EngineConfig field")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.weights_on = "cpu"
    if args.cpus_per_replica is None:  # an update's host work in a replica runs on this many threads
        args.cpus_per_replica = 8.0 if args.device == "cuda" else 1.0
    args.phases = (args.phases or f"pool{args.replicas},pool1,engine").split(",")
    result = asyncio.run(run(args))
    print(json.dumps(result["figures"], indent=2))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
