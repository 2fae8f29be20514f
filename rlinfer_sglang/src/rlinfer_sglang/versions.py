"""Per-token weight versions of the samples SGLang serves (see the README, "Token versions").

SGLang's scheduler handles its input messages in order, and rlinfer's loader runs inside it: at
load time the loader records ``len(req.output_ids)`` of every request the scheduler holds
(waiting, running, retracted by a pause). For one update and one sample (an SGLang rid):

- the rid is in that record with ``k`` tokens: tokens ``[0, k)`` came from the old weights, the
  rest from the new ones;
- the rid is not in it, but the tokenizer manager had dispatched it before the update was sent:
  it finished in the scheduler before the load, so every token is old;
- otherwise it reached the scheduler after the load: every token is new.

(An update while requests run unpaused waits in SGLang until they finished: its write lock
waits for every request in flight; requests that started later carry the new version.)

Where requests carry a per-version cache key (``Transport.salts``), the key follows the same
boundaries: a sample is admitted with the key of :meth:`TokenVersions.started`, the update waits
until every admitted sample reached the scheduler, and the loader gives every request that has
computed no KV yet (waiting, retracted: recorded with 0 or k tokens whose KV is dropped) the new
version's key, so what the new weights compute never attends to a prefix cached by older ones
unless it is the sample's own KV from before the switch (the "mixed" reading).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping


class TokenVersions:
    """Weight version of each token of every sample in flight, by SGLang rid."""

    def __init__(self) -> None:
        self.current = 0
        self._start: dict[str, int] = {}
        #: rid -> [(first token index computed by the new weights, new version), ...] in order
        self._marks: dict[str, list[tuple[float, int]]] = {}

    def admit(self, rid: str) -> None:
        """A sample starts: its tokens carry the current version until an update lands."""
        self._start[rid] = self.current
        self._marks[rid] = []

    def started(self, rid: str) -> int:
        """The version sample ``rid`` was admitted under (its first tokens' version, its cache key's)."""
        return self._start.get(rid, self.current)

    def loaded(self, version: int, in_flight: Iterable[str], dispatched: set[str], lengths: Mapping[str, int]) -> None:
        """An update to ``version`` was loaded.

        ``in_flight``: rids of samples not returned yet; ``dispatched``: those the tokenizer
        manager had sent to the scheduler before the update was sent; ``lengths``: the loader's
        record (rid -> tokens produced before the load).
        """
        for rid in in_flight:
            if rid not in self._marks:
                continue
            boundary: float = lengths.get(rid, math.inf if rid in dispatched else 0)
            self._marks[rid].append((boundary, version))
        self.current = version

    def of(self, rid: str, count: int, start: int = 0) -> tuple[int, ...]:
        """Versions of tokens ``[start, count)`` of sample ``rid``: for each token, the last mark
        whose boundary it reached, else the version it started with. Built a run at a time (the
        version only changes at a boundary), not token by token: this runs for every token of
        every sample."""
        if count <= start:
            return ()
        base = self._start.get(rid, self.current)
        marks = self._marks.get(rid, [])
        cuts = sorted({start, count, *(math.ceil(b) for b, _ in marks if start < b < count)})
        out: list[int] = []
        for lo, hi in itertools.pairwise(cuts):
            version = base
            for boundary, new in marks:
                if lo >= boundary:
                    version = new
            out.extend([version] * (hi - lo))
        return tuple(out)

    def forget(self, rid: str) -> None:
        """The sample returned."""
        self._start.pop(rid, None)
        self._marks.pop(rid, None)
