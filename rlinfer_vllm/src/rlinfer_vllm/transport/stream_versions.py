"""Exact per-token weight versions for the deltas of a server-mode stream.

vLLM's token endpoint sends a stream's weight-version spans only with each sample's last chunk,
so a delta's version is decided here, exactly:

- every weight update is loaded while the scheduler is paused, and the backend counts a *switch*
  (``epoch``) just before it sends the ``/resume`` that lets the new weights compute; so a delta
  read while the epoch is the one the stream started under holds tokens of the version then
  serving (the engine computed nothing with newer weights yet);
- a delta read after a switch may still hold tokens computed before it (in transit in the API
  server, on the loopback socket, or not yet pulled by the consumer): from then on the sample's
  deltas are held back and released with the last chunk, stamped from vLLM's spans.

Cost: a stream that crosses a weight update delivers the rest of that sample at its end.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from rlinfer_vllm.token_endpoint import expand_versions


class StreamVersions:
    """Versions for the choices (chunks of one sample index) of one stream."""

    def __init__(self, epoch: int, version: int) -> None:
        self.epoch = epoch
        self.version = version
        self._sent: dict[int, int] = {}  # sample index -> tokens released so far
        self._held: dict[int, list[Mapping[str, Any]]] = {}

    def take(
        self, choice: Mapping[str, Any], epoch: int, fallback: int
    ) -> Iterator[tuple[Mapping[str, Any], tuple[int, ...]]]:
        """The choices releasable now, each with its tokens' versions. ``epoch``: the backend's
        switch count now; ``fallback``: the version for tokens vLLM's spans do not label."""
        index = int(choice["index"])
        count = len(choice.get("token_ids") or ())
        if epoch == self.epoch and index not in self._held:
            self._sent[index] = self._sent.get(index, 0) + count
            yield choice, (self.version,) * count
            return
        held = self._held.setdefault(index, [])
        held.append(choice)
        if choice.get("finish_reason") is not None:
            yield from self._release(index, choice.get("weight_versions"), fallback)

    def flush(self, fallback: int) -> Iterator[tuple[Mapping[str, Any], tuple[int, ...]]]:
        """Whatever is still held when the stream ended without a last chunk."""
        for index in list(self._held):
            yield from self._release(index, None, fallback)

    def _release(self, index: int, spans: Any, fallback: int) -> Iterator[tuple[Mapping[str, Any], tuple[int, ...]]]:
        held = self._held.pop(index)
        start = self._sent.get(index, 0)
        total = start + sum(len(c.get("token_ids") or ()) for c in held)
        versions = expand_versions(spans, total, fallback)
        for choice in held:
            count = len(choice.get("token_ids") or ())
            yield choice, versions[start : start + count]
            start += count
        self._sent[index] = start
