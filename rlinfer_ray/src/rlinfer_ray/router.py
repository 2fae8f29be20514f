"""The data plane's choice of replica: least outstanding, round robin, or sticky sessions.

Loads are counted in samples in flight (a request with ``n=8`` weighs 8, or 1 per sample when
the pool spreads the group). The session policy is rendezvous hashing with bounded loads: a
session key ranks the replicas the same way every time (so its prefixes stay warm in one
replica's cache), and the first replica in that order whose load stays within
``ceil(load_factor * mean load)`` takes the work. One hot session therefore fills its home
replica up to the bound and spills the rest of a GRPO group over to the others, instead of
pinning the whole group to one replica.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence

from rlinfer_ray.config import RouterPolicy


def session_order(session: str, candidates: Sequence[int]) -> list[int]:
    """Replicas ranked for ``session`` (rendezvous hashing: stable while the set is stable)."""

    def score(index: int) -> bytes:
        return hashlib.blake2b(f"{session}\x00{index}".encode(), digest_size=8).digest()

    return sorted(candidates, key=score, reverse=True)


class Router:
    """Picks replicas under one :class:`RouterPolicy`. Not thread-safe: the pool's loop owns it."""

    def __init__(self, policy: RouterPolicy, load_factor: float = 1.25) -> None:
        self.policy = RouterPolicy(policy)
        self.load_factor = load_factor
        self._turn = itertools.count()

    def pick(
        self, candidates: Sequence[int], loads: Mapping[int, int], cost: int = 1, session: str | None = None
    ) -> int:
        """The replica (from ``candidates``, non-empty) to take ``cost`` more samples."""
        if not candidates:
            raise ValueError("no replica to route to")
        turn = next(self._turn)
        if self.policy is RouterPolicy.ROUND_ROBIN:
            return candidates[turn % len(candidates)]
        if self.policy is RouterPolicy.SESSION and session is not None:
            total = sum(loads.get(i, 0) for i in candidates) + cost
            bound = max(cost, math.ceil(self.load_factor * total / len(candidates)))
            for index in session_order(session, candidates):
                if loads.get(index, 0) + cost <= bound:
                    return index
        # least outstanding; ties rotate so an idle pool still spreads work
        rotated = [candidates[(turn + k) % len(candidates)] for k in range(len(candidates))]
        return min(rotated, key=lambda i: loads.get(i, 0))

    def spread(
        self, candidates: Sequence[int], loads: Mapping[int, int], samples: int, session: str | None = None
    ) -> dict[int, int]:
        """Assign ``samples`` samples one by one; ``{replica: how many}`` (loads are not changed)."""
        tentative = dict(loads)
        out: dict[int, int] = {}
        for _ in range(samples):
            index = self.pick(candidates, tentative, 1, session)
            tentative[index] = tentative.get(index, 0) + 1
            out[index] = out.get(index, 0) + 1
        return out
