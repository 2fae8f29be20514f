"""rlinfer_core.cpu_binding: each rank of a CPU engine gets its own share of the cores."""

from __future__ import annotations

import pytest

from rlinfer_core import cpu_binding
from rlinfer_core.errors import InvalidRequest


def test_cores_split_evenly_in_cpulist_syntax() -> None:
    assert cpu_binding.cores_per_rank([0, 1], 2) == "0|1"
    assert cpu_binding.cores_per_rank([0, 1, 2, 3, 6, 7, 9], 2) == "0-2|3,6-7"
    assert cpu_binding.cores_per_rank(list(range(8)), 4) == "0-1|2-3|4-5|6-7"
    with pytest.raises(InvalidRequest, match="tensor_parallel_size"):
        cpu_binding.cores_per_rank([0], 2)


def test_binding_only_where_the_engines_default_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda _pid: {4, 5, 6, 7})
    monkeypatch.setattr(cpu_binding, "numa_nodes", lambda: 1)
    assert cpu_binding.binding_for(1) is None
    assert cpu_binding.binding_for(2) == "4-5|6-7"
    monkeypatch.setattr(cpu_binding, "numa_nodes", lambda: 2)  # one node per rank: the default
    assert cpu_binding.binding_for(2) is None
