"""Check that the Ray of the bundle works here: a local ``ray.init``, an actor, a placement group.

    python3 dev/gpu/ray_smoke.py [--json-out FILE]

Starts Ray the way rlinfer_ray's pool does (``include_dashboard=False``, workers at niceness 0),
then: one plain actor answers; a placement group of one bundle per GPU (``{"GPU": 1}``; on a
machine without GPUs two ``{"CPU": 1}`` bundles) is placed and an actor in each bundle reports its
pid and the GPU ids Ray gave it (``CUDA_VISIBLE_DEVICES``). Prints one JSON object (also written
to ``--json-out``); exit 0 when everything answered. Every wait is bounded (no hang on a broken
install). Uses nothing of the repo, so it also checks a bundle before rlinfer is on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TIMEOUT_S = 120.0


def smoke() -> dict[str, Any]:
    """Run the checks; the facts found."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    out: dict[str, Any] = {"python": sys.version.split()[0], "ray_file": ray.__file__}
    t0 = time.perf_counter()
    ray.init(
        num_cpus=max(2, os.cpu_count() or 1),
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
        _system_config={"worker_niceness": 0},
    )
    out["init_s"] = round(time.perf_counter() - t0, 2)
    out["ray_version"] = ray.__version__
    resources = {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}
    out["resources"] = resources

    @ray.remote(num_cpus=0)
    class Probe:
        def facts(self) -> dict[str, Any]:
            return {
                "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            }

    t0 = time.perf_counter()
    plain = Probe.remote()  # type: ignore[attr-defined]
    out["actor"] = ray.get(plain.facts.remote(), timeout=TIMEOUT_S)
    out["actor_s"] = round(time.perf_counter() - t0, 2)

    gpus = int(resources.get("GPU", 0))
    shapes = [{"CPU": 1.0, "GPU": 1.0}] * gpus if gpus else [{"CPU": 1.0}] * 2
    t0 = time.perf_counter()
    group = placement_group(shapes, strategy="PACK")
    ray.get(group.ready(), timeout=TIMEOUT_S)
    members = []
    for i, shape in enumerate(shapes):
        actor = Probe.options(  # type: ignore[attr-defined]
            num_cpus=shape["CPU"],
            num_gpus=shape.get("GPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i),
        ).remote()
        members.append(actor)
    out["bundles"] = shapes
    out["bundle_actors"] = ray.get([m.facts.remote() for m in members], timeout=TIMEOUT_S)
    out["placement_group_s"] = round(time.perf_counter() - t0, 2)
    remove_placement_group(group)
    ray.shutdown()
    out["ok"] = len({f["pid"] for f in out["bundle_actors"]}) == len(shapes)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    try:
        result = smoke()
    except Exception as exc:  # reported, not raised: the JSON is what comes back from the device
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
