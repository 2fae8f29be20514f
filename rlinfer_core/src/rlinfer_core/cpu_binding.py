"""Cores for each rank of a CPU engine with several ranks (tensor / data parallelism on CPU).

vLLM and SGLang bind one NUMA node per rank by default and refuse more ranks than the host has
nodes; both accept an explicit binding instead (``VLLM_CPU_OMP_THREADS_BIND`` /
``SGLANG_CPU_OMP_THREADS_BIND``: one Linux cpulist per rank, ``|``-separated). The backends use
:func:`binding_for` to give each rank its own share of the cores this process may use.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlinfer_core.errors import InvalidRequest


def binding_for(ranks: int) -> str | None:
    """The binding for ``ranks`` ranks on this host, or None when the engine's default (one NUMA
    node per rank) fits."""
    if ranks <= 1 or ranks <= numa_nodes():
        return None
    return cores_per_rank(sorted(os.sched_getaffinity(0)), ranks)


def cores_per_rank(cores: list[int], ranks: int) -> str:
    """``cores`` split into ``ranks`` equal groups, in the engines' ``a-b,c|d-e`` syntax."""
    share = len(cores) // ranks
    if share < 1:
        raise InvalidRequest(
            "tensor_parallel_size",
            f"{ranks} engine ranks on CPU need a core each; this process may use {len(cores)} "
            "(or set the engine's CPU binding variable yourself)",
        )
    return "|".join(cpulist(cores[i * share : (i + 1) * share]) for i in range(ranks))


def cpulist(cores: list[int]) -> str:
    """Linux cpulist syntax: runs of consecutive cores as ``a-b``, joined by commas."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def numa_nodes() -> int:
    """NUMA nodes of this host (1 when the kernel does not say)."""
    return max(1, len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))))
