"""Per-rank outcomes of worker calls (rlinfer_vllm.ranks): pure logic, no engine."""

from __future__ import annotations

import pytest

from rlinfer_core.errors import WeightUpdateError
from rlinfer_vllm.ranks import WorkerCallFailed, outcome_of, rank_zero_result


def _reject() -> None:
    raise WeightUpdateError("weight update rejected by the vLLM worker", ("w: bad shape",))


def test_rank_zero_result_when_every_rank_succeeds() -> None:
    outcomes = [outcome_of(0, lambda: {"load_s": 1.0}), outcome_of(1, lambda: {"load_s": 2.0})]
    assert rank_zero_result("rlinfer_load_dir", outcomes, ranks=2) == {"load_s": 1.0}


def test_a_failure_on_any_rank_fails_the_call_and_names_the_rank() -> None:
    outcomes = [outcome_of(0, lambda: {}), outcome_of(1, _reject)]
    with pytest.raises(WeightUpdateError, match=r"on 1 of 2 ranks") as caught:
        rank_zero_result("rlinfer_load_ipc", outcomes, ranks=2)
    assert caught.value.problems == ("rank 1: w: bad shape",)


def test_other_worker_errors_and_missing_ranks_are_failures() -> None:
    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(WorkerCallFailed, match="rank 0"):
        rank_zero_result("rlinfer_join_group", [outcome_of(0, boom), outcome_of(1, lambda: 2)], ranks=2)
    with pytest.raises(WorkerCallFailed, match="1 of 2 workers answered"):
        rank_zero_result("rlinfer_join_group", [outcome_of(0, lambda: 1)], ranks=2)
