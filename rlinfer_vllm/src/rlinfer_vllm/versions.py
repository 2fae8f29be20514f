"""Per-token weight versions for the vLLM backend.

The engine core sends each step's new tokens (``EngineCoreOutputs``) and the results of utility
calls (pause, collective_rpc) over one socket, in the order it produced them; AsyncLLM's socket
task puts the step outputs on ``engine_core.outputs_queue`` in that order, before it resolves the
utility call that follows them. :class:`TokenVersions` counts every request's new tokens *at that
point* and stamps them with the version then live.

A weight update is loaded while vLLM's scheduler is paused (the caller's ``pause(keep)``, or a
pause in "keep" mode that the backend takes around the load itself): vLLM answers the pause only
once no step is in flight and every earlier step's outputs went out. So every token counted before
the version switch was computed by the old weights, and every token after it by the new ones. A
load the engine core runs at its own step boundary (:mod:`rlinfer_vllm.engine_core.step_boundary`)
switches where its reply comes in (:meth:`TokenVersions.switch_on`), which the engine core sends
between the last old and the first new step's outputs.

Prefix-cache salt: every request reaches vLLM with a ``cache_salt`` naming the version live when
it was admitted (:func:`cache_salt`, taken by :meth:`TokenVersions.admit` in the same step as the
backend's load gate admits it), and vLLM hashes a prompt's first block with it. A prefix computed
by older weights is then never hit by a request of a newer version, so a weight update needs no
prefix-cache reset unless a request admitted before it has not finished its prefill yet (it would
prefill with the new weights under the old salt): :attr:`TokenVersions.unstarted` says so.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

#: (the caller's request id, sample index)
Key = tuple[str, int]


def salt_nonce() -> str:
    """A per-backend prefix for its salts: two backends (or two attachments to one server) count
    versions from 0 each, and must not read each other's prefixes."""
    return uuid.uuid4().hex[:12]


def cache_salt(nonce: str, version: int) -> str:
    """vLLM's ``cache_salt`` for requests served by weight ``version`` (non-empty, at most 128
    characters, none of ``@ / \\`` or NUL, as vLLM requires)."""
    return f"rlinfer-{nonce}-v{version}"


class TokenVersions:
    """Version runs of every sample's tokens, fed from the engine client's output queue."""

    def __init__(self, llm: Any) -> None:
        self.version = 0  #: the version of the weights the engine computes with now
        self.nonce = salt_nonce()
        #: samples admitted with a salt whose first token was not counted yet, by request id
        self._unstarted: dict[str, set[int]] = {}
        self._states = llm.output_processor.request_states
        self._runs: dict[Key, list[list[int]]] = {}
        self._taken: dict[Key, int] = {}
        #: a load's reply, the version it starts, and whether a reply says the load took
        self._switch: tuple[asyncio.Future[Any], int, Callable[[Any], bool]] | None = None
        queue = llm.engine_core.outputs_queue
        put = queue.put_nowait

        def counting_put(item: Any) -> None:
            if not isinstance(item, BaseException):
                self._switch_if_answered()
                self._count(item)
            put(item)

        queue.put_nowait = counting_put

    def _count(self, outputs: Any) -> None:
        for out in getattr(outputs, "outputs", None) or ():
            n = len(out.new_token_ids)
            state = self._states.get(out.request_id) if n else None
            if state is None:
                continue
            parent = getattr(state, "parent_req", None)
            external = getattr(parent if parent is not None else state, "external_req_id", None) or out.request_id
            index = int(getattr(state, "request_index", 0))
            waiting = self._unstarted.get(external)
            if waiting is not None:
                waiting.discard(index)
                if not waiting:
                    del self._unstarted[external]
            runs = self._runs.setdefault((external, index), [])
            if runs and runs[-1][0] == self.version:
                runs[-1][1] += n
            else:
                runs.append([self.version, n])

    def switch_on(self, reply: asyncio.Future[Any], version: int, took: Callable[[Any], bool]) -> None:
        """Switch to ``version`` where ``reply`` (a utility call's future) is answered, if
        ``took(result)``: the engine core sends the reply after the outputs of the steps before the
        load and before those of the steps after, and the client's output task resolves it in
        that order, so the first outputs counted after it is done are the new version's."""
        self._switch = (reply, version, took)

    def _switch_if_answered(self) -> None:
        if self._switch is None or not self._switch[0].done():
            return
        reply, version, took = self._switch
        self._switch = None
        if not reply.cancelled() and reply.exception() is None and took(reply.result()):
            self.version = version

    def settle_switch(self) -> None:
        """After the reply was awaited: switch now if no output came after it."""
        self._switch_if_answered()

    def admit(self, request_id: str, n: int) -> str:
        """The salt of a request the load gate admits now with ``n`` samples (the live version),
        counted as unstarted until each sample's first token is counted."""
        self._unstarted[request_id] = set(range(n))
        return cache_salt(self.nonce, self.version)

    @property
    def unstarted(self) -> bool:
        """Whether an admitted sample has no token counted yet (it may not have prefilled)."""
        return bool(self._unstarted)

    def take(self, request_id: str, index: int, count: int) -> tuple[int, ...]:
        """Versions of the sample's next ``count`` tokens (a stream consumes them delta by delta).

        Tokens the queue has not counted (none, unless vLLM changes how outputs travel) get the
        live version.
        """
        key = (request_id, index)
        start = self._taken.get(key, 0)
        self._taken[key] = start + count
        flat: list[int] = []
        for version, n in self._runs.get(key, ()):
            flat.extend([version] * n)
            if len(flat) >= start + count:
                break
        got = flat[start : start + count]
        return tuple(got) + (self.version,) * (count - len(got))

    def forget(self, request_id: str, n: int) -> None:
        """Drop what is kept for the request's ``n`` samples."""
        self._unstarted.pop(request_id, None)
        for index in range(n):
            self._runs.pop((request_id, index), None)
            self._taken.pop((request_id, index), None)
