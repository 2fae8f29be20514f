"""Check CUDA-IPC buffer reuse without an engine (torch only; seconds on the device machine).

A sender packs the same layout several times (``rlinfer_core.transfer.arena.PackArena``, or
fresh buffers with ``--fresh``) and hands the buckets to a spawned receiver as the backends do
(``ipc.dumps`` bytes); the receiver maps them (``ipc.loads``), keeps them (``ipc.keep_mapped``),
copies them out, synchronizes and answers: buckets it had mapped already, its map time, and a
checksum of what it read, which the sender compares with its own tensors. Then a new layout
(nothing reused) and the arena cleared while the receiver still holds its buffers.

    PYTHONPATH=rlinfer_core/src python3 dev/gpu/ipc_reuse_probe.py [--mib 1200] [--updates 6]

Prints one JSON document; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def receiver(conn: Any) -> None:
    """Map, keep, read and answer each payload until ``None`` arrives."""
    import pickle

    import torch

    from rlinfer_core.transfer import ipc
    from rlinfer_core.transfer.buckets import unpack_all
    from rlinfer_core.weights import Bucket

    torch.cuda.init()
    while (message := conn.recv()) is not None:
        manifests, payload = message
        started = time.perf_counter()
        datas = [t for _, t in ipc.loads(payload)]
        map_s = time.perf_counter() - started
        reused = ipc.keep_mapped(datas)
        tensors = unpack_all([Bucket(m, d) for m, d in zip(pickle.loads(manifests), datas, strict=True)], check=False)
        copies = [t.clone() for _, t in tensors]  # copy out, as every load does, then synchronize
        torch.cuda.current_stream().synchronize()
        total = float(sum(c.double().sum().item() for c in copies))
        conn.send({"map_s": map_s, "reused": reused, "buckets": len(datas), "sum": total})


def layout(mib: int, shift: int) -> list[tuple[str, Any]]:
    """About ``mib`` MiB of bf16 tensors in 219 pieces (as the bench model), and a float32 one."""
    import torch

    rows = max(1, (mib << 20) // (2 * 4096 * 218))
    tensors = [
        (f"layer.{i}.weight", torch.randn(rows + shift, 4096, dtype=torch.bfloat16, device="cuda")) for i in range(218)
    ]
    return [*tensors, ("norm.weight", torch.randn(4096 + shift, dtype=torch.float32, device="cuda"))]


def main() -> int:
    import pickle

    import torch
    import torch.multiprocessing as mp

    from rlinfer_core.transfer import ipc
    from rlinfer_core.transfer.arena import PackArena

    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1200)
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--fresh", action="store_true", help="no arena: fresh buffers every update")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(there,), daemon=True)
    child.start()
    arena = None if args.fresh else PackArena()
    rows: list[dict[str, Any]] = []
    failures: list[str] = []

    def update(tensors: list[tuple[str, Any]], what: str) -> dict[str, Any]:
        started = time.perf_counter()
        buckets = ipc.pack_cuda(tensors, arena=arena)
        assert buckets is not None
        pack_s = time.perf_counter() - started
        payload = ipc.dumps([(str(i), b.data) for i, b in enumerate(buckets)])
        here.send((pickle.dumps([b.manifest for b in buckets]), payload))
        answer: dict[str, Any] = here.recv()
        want = float(sum(t.double().sum().item() for _, t in tensors))
        answer.update(what=what, pack_s=pack_s, values_ok=abs(answer["sum"] - want) <= 1e-6 * max(1.0, abs(want)))
        if not answer["values_ok"]:
            failures.append(f"{what}: the receiver read other values ({answer['sum']} != {want})")
        rows.append(answer)
        return answer

    first = layout(args.mib, 0)
    for step in range(args.updates):
        for _, t in first:
            t.add_(1.0 if step else 0.0)  # new values in the same tensors
        answer = update(first, f"same layout #{step}")
        expect = 0 if step == 0 or arena is None else answer["buckets"]
        if answer["reused"] != expect:
            failures.append(f"update {step}: {answer['reused']} buckets mapped before, expected {expect}")
    second = layout(args.mib, 1)
    answer = update(second, "new layout")
    if answer["reused"] != 0:
        failures.append(f"a new layout reused {answer['reused']} buckets")
    if arena is not None:
        arena.clear()  # the receiver still holds the new layout's buffers: they wait in torch's limbo
    answer = update(second, "after clear")
    if answer["reused"] != 0:
        failures.append(f"after clear: {answer['reused']} buckets mapped before")
    here.send(None)
    child.join(30)
    later = [r for r in rows[1 : args.updates]]
    doc = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "arena": arena is not None,
        "mib": args.mib,
        "median_later_map_ms": sorted(r["map_s"] for r in later)[len(later) // 2] * 1e3 if later else None,
        "median_later_pack_ms": sorted(r["pack_s"] for r in later)[len(later) // 2] * 1e3 if later else None,
        "updates": [
            {k: (round(v * 1e3, 3) if k.endswith("_s") else v) for k, v in r.items() if k != "sum"} for r in rows
        ],
        "failures": failures,
    }
    print(json.dumps(doc, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
