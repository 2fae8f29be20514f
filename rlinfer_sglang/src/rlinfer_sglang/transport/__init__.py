"""How the one SGLang backend reaches its engine: a transport makes the engine calls, and only them.

:class:`rlinfer_sglang.backend.SGLangBackend` writes admission, in-flight tracking, version
stamping, conversion, pause/abort semantics, weight-update sequencing and capabilities once; a
:class:`Transport` carries its calls to SGLang (the way httpx's one client runs over interchangeable
transports):

- :class:`~rlinfer_sglang.transport.in_process.InProcessTransport`: SGLang's offline ``Engine``,
  its tokenizer manager in this process and event loop (the default);
- :class:`~rlinfer_sglang.transport.http.HttpTransport`: SGLang's own HTTP server, launched as a
  child (``mode="server"``) or attached to (``server_url``).

What a flavour cannot do is data it reports (``begin_end``, ``salts``, ``abort_settle_s``, the capabilities
it refines at start), never a mode test in the backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from rlinfer_core.types import Capabilities, Capability

T = TypeVar("T")


@attrs.frozen
class Served:
    """What a started engine serves, as its transport found it."""

    #: the caller's capabilities refined by what this engine (and its transport) can do
    capabilities: Capabilities
    #: the model's context length, and the longest prompt SGLang accepts (None: not reported)
    context_len: int
    max_req_input_len: int | None
    vocab_size: int
    eos_token_ids: frozenset[int]
    tied_embeddings: bool
    #: the dtype SGLang serves the weights in (None: the checkpoint's, for dtype="auto")
    served_dtype: str | None
    #: the directory holding the checkpoint's safetensors (its parameter names and shapes)
    model_dir: str
    #: the model's tokenizer, as SGLang loads it (None: not loadable here)
    tokenizer: Any
    #: rlinfer priority -> SGLang's (rlinfer_sglang.requests.priority_sign); None: no priority scheduling
    priority_sign: int | None
    #: the model's hidden size where the engine reports it (else read from config.json)
    hidden_size: int | None = None


class Transport(Protocol):
    """The engine calls of one SGLang engine; bodies are ``GenerateReqInput`` fields
    (:mod:`rlinfer_sglang.requests`), answers SGLang's output dicts (:mod:`rlinfer_sglang.outputs`)."""

    #: SGLang's tp_size: every rank of the engine (one weight payload each)
    tp_size: int
    #: SGLang has begin/end_weight_update (>= 0.5.2x; 0.5.16 has neither); found at start
    begin_end: bool
    #: SGLang flushes its cache only when no request is pending, a retracted one included, and its
    #: scheduler dies when the flush inside a weight update fails (SGLang without begin/end,
    #: 0.5.16): updates wait for running requests, flushes happen outside the update
    flush_needs_idle: bool
    #: requests carry a per-weight-version ``extra_key`` (rlinfer_sglang.requests.cache_key), so a
    #: weight update needs no cache flush and no idle scheduler; False where the transport cannot
    #: tell when a request reached the scheduler (``unsent``), which the key's exactness needs
    salts: bool
    #: SGLang's pause mode that holds requests in flight during a salted update: "in_place" keeps
    #: their KV; "retract" where the scheduler overlaps steps (an in-place pause leaves a step's
    #: results unprocessed, so the loader would miss its tokens)
    update_pause: str
    #: what this flavour never does, known before the engine starts (capability -> why)
    off_before_start: Mapping[Capability, str]
    #: how long abort keeps re-aborting requests that had not reached SGLang yet (0: they all had)
    abort_settle_s: float

    async def start(self, capabilities: Capabilities) -> Served:
        """Start (or attach to) the engine and report what it serves."""

    def alive(self) -> None:
        """Raise EngineDead when the engine is shut down or one of its processes died."""

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` unless the engine dies first (then raise EngineDead)."""

    def translate(self, exc: Exception) -> Exception:
        """``exc`` as EngineDead when the engine died meanwhile, else ``exc``."""

    async def generate(self, body: Mapping[str, Any]) -> Any:
        """One (possibly batched) generate call: an output dict, or a list for a batch."""

    def stream(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """SGLang's cumulative outputs of one streamed sample."""

    async def abort(self, rids: Sequence[str]) -> None:
        """Abort these SGLang rids."""

    def abort_soon(self, rids: Sequence[str]) -> None:
        """Abort these rids without waiting (from a cancelled call)."""

    async def pause(self, mode: str) -> None:
        """SGLang's pause_generation (``"abort"`` or ``"retract"``)."""

    async def unpause(self) -> None:
        """SGLang's continue_generation."""

    async def flush(self, wait_s: float = 0.0) -> bool:
        """Flush SGLang's cache; ``wait_s`` > 0: as soon as it is idle, within that time."""

    async def release_memory(self, tags: list[str]) -> None:
        """SGLang's release_memory_occupation of ``tags`` (its memory saver)."""

    async def resume_memory(self, tags: list[str]) -> None:
        """SGLang's resume_memory_occupation of ``tags``."""

    async def serialize(self, pairs: list[tuple[str, Any]]) -> list[Any]:
        """``update_weights_from_tensor``'s ``serialized_named_tensors``: a payload per TP rank."""

    async def begin_update(self) -> tuple[bool, str]:
        """SGLang's begin_weight_update: ``(ok, message)``."""

    async def update_tensors(
        self, payloads: list[Any], flush: bool, before_send: Callable[[], None] | None
    ) -> tuple[bool, str]:
        """``update_weights_from_tensor`` with rlinfer's loader; ``before_send`` runs right before
        the message leaves (no other task runs in between)."""

    async def end_update(self) -> tuple[bool, str]:
        """SGLang's end_weight_update: ``(ok, message)`` (runs even when its caller is cancelled)."""

    async def label(self, version: int) -> tuple[bool, str]:
        """Set SGLang's weight-version label to ``version`` while nothing runs (where the
        transport reads per-token versions from SGLang's spans)."""

    def dispatched(self, rids: Sequence[str], received: Mapping[str, int]) -> set[str]:
        """Those of ``rids`` that SGLang's scheduler had been sent before now."""

    def unsent(self, rids: Sequence[str]) -> list[str]:
        """Those of ``rids`` known not to have reached SGLang's scheduler yet (where ``salts``)."""

    async def update_from_disk(self, path: str) -> tuple[bool, str]:
        """SGLang's own ``update_weights_from_disk`` (the bench baseline), without a flush."""

    async def raw_generate(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """SGLang's own batched generate (the bench baseline)."""

    async def load_lora(self, name: str, path: str) -> tuple[bool, str]:
        """Load the PEFT adapter at ``path`` as SGLang adapter ``name``: ``(ok, error)``."""

    async def unload_lora(self, name: str) -> tuple[bool, str]:
        """Unload SGLang adapter ``name``: ``(ok, error)``."""

    def lora_names(self) -> set[str]:
        """Names of the adapters SGLang holds."""

    async def check_health(self) -> None:
        """EngineDead when a process died or the engine does not answer."""

    async def shutdown(self) -> None:
        """Stop what this engine started (an attached server keeps running)."""

    def processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes that this engine manages."""
