"""Environment variables an SGLang engine needs, for the in-process engine's processes (set in
this process around the start) and for a server child (its environment only).

Only variables the caller has not set are returned: the caller's choice always wins.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import EngineConfig
from rlinfer_sglang.config import needs_context_override

#: SGLang's per-TP-rank CPU core binding on CPU ("0-3|4-7": cores of rank 0 | rank 1)
THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"


def engine_environment(config: EngineConfig, platform: str) -> dict[str, str]:
    """What to add to the environment of the engine's processes."""
    env: dict[str, str] = {}
    if platform == "cpu":
        if "OMP_NUM_THREADS" not in os.environ:
            # without it torch uses every core and, with the caller's own threads, CPU decoding
            # jitters by an order of magnitude
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
        ranks = config.tensor_parallel_size * config.data_parallel_size
        if ranks > 1 and THREADS_BIND not in os.environ and ranks > _numa_nodes():
            env[THREADS_BIND] = cores_per_rank(sorted(os.sched_getaffinity(0)), ranks)
    if needs_context_override(config) and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" not in os.environ:
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    return env


def cores_per_rank(cores: list[int], ranks: int) -> str:
    """``cores`` split into ``ranks`` equal groups in SGLANG_CPU_OMP_THREADS_BIND's syntax.

    SGLang binds one NUMA node per rank by default and refuses more ranks than nodes; on a host
    with fewer nodes, each rank gets its own share of the cores this process may use.
    """
    share = len(cores) // ranks
    if share < 1:
        raise InvalidRequest(
            "tensor_parallel_size",
            f"tensor_parallel_size x data_parallel_size = {ranks} SGLang ranks on CPU need a core each; "
            f"this process may use {len(cores)} (or set {THREADS_BIND} yourself)",
        )
    groups = [cores[i * share : (i + 1) * share] for i in range(ranks)]
    return "|".join(_cpulist(group) for group in groups)


def _cpulist(cores: list[int]) -> str:
    """Linux cpulist syntax: runs of consecutive cores as ``a-b``, joined by commas."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(1, len(nodes))
