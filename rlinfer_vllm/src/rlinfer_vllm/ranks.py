"""Outcomes of one ``collective_rpc`` from every vLLM worker (one per tensor-parallel rank).

Worker methods report an outcome instead of raising (:meth:`RLInferWorkerExtension.rlinfer_call`):
vLLM's executor stops reading replies at the first rank that failed, so the other ranks' replies
would stay queued and be read as the answers to the *next* call. With an outcome from every rank,
the replies stay in step, and a failure on any rank is a failure of the whole call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlinfer_core.errors import WeightUpdateError

Outcome = Mapping[str, Any]


class WorkerCallFailed(RuntimeError):
    """A worker method raised something other than a ``WeightUpdateError`` on some rank."""


def outcome_of(rank: int, call: Any) -> dict[str, Any]:
    """Run ``call()`` and describe what happened (the worker side)."""
    try:
        return {"ok": True, "rank": rank, "result": call()}
    except Exception as exc:
        problems = [str(p) for p in getattr(exc, "problems", ())]
        return {"ok": False, "rank": rank, "error": type(exc).__name__, "message": str(exc), "problems": problems}


def rank_zero_result(method: str, outcomes: Sequence[Outcome], ranks: int) -> Any:
    """Rank 0's result once every one of ``ranks`` ranks succeeded; else raise naming each rank
    that failed (``WeightUpdateError`` when any rank rejected the update itself)."""
    if len(outcomes) != ranks:
        raise WorkerCallFailed(f"{method}: {len(outcomes)} of {ranks} workers answered")
    failed = [o for o in outcomes if not o["ok"]]
    if not failed:
        return outcomes[0]["result"]
    problems = tuple(f"rank {o['rank']}: {p}" for o in failed for p in (o["problems"] or [o["message"]]))
    if any(o["error"] == "WeightUpdateError" for o in failed):
        first = failed[0]["message"].split("\n")[0]
        raise WeightUpdateError(f"{first} (on {len(failed)} of {ranks} ranks)", problems)
    raise WorkerCallFailed(f"{method} failed on {len(failed)} of {ranks} ranks: " + "; ".join(problems))


__all__ = ["WorkerCallFailed", "outcome_of", "rank_zero_result"]
