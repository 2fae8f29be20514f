"""How :class:`rlinfer_vllm.backend.VllmBackend` reaches its engine: the calls both flavours make.

- :class:`rlinfer_vllm.transport.in_process.InProcessTransport`: vLLM's ``AsyncLLM`` in this
  process (engine core and workers in child processes), ``collective_rpc`` into rlinfer's worker
  extension;
- :class:`rlinfer_vllm.transport.http.HttpTransport`: vLLM's own API server (launched as a child
  process, or attached by ``server_url``), its HTTP endpoints and ``/collective_rpc``.

The backend writes every concern once over this surface (admission, in-flight tracking and abort,
pause and weight-load sequencing, memory tags, capabilities); a transport makes the engine calls
and reports what its engine can do as data (``gated``, ``kv_cache_release``,
capabilities refined at start). A flavour that cannot do something raises UnsupportedCapability
with the note its capabilities carry (the facade's capability gate refuses first).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from rlinfer_core.lora import LoraAdapter
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.tools import ToolCalls, ToolSpec
from rlinfer_core.types import Capabilities, Completion, CompletionDelta, GenerateRequest, PauseMode
from rlinfer_core.weights import TensorSpec

#: how often calls look for exited engine processes (a dead worker -> EngineDead)
PROCESS_CHECK_S = 0.2


class ProcessWatch:
    """Pids of the engine's processes that exited (``dead`` lists them), looked up at most every
    PROCESS_CHECK_S (it reads /proc per process, and runs per request) unless one was found dead."""

    def __init__(self, dead: Callable[[], list[int]]) -> None:
        self._dead = dead
        self._pids: list[int] = []
        self._checked_at = 0.0

    def __call__(self) -> list[int]:
        """The pids found dead (a fresh look if the last is older than PROCESS_CHECK_S)."""
        now = time.monotonic()
        if now - self._checked_at >= PROCESS_CHECK_S or self._pids:
            self._pids = self._dead()
            self._checked_at = now
        return self._pids

    def look_now(self) -> None:
        """The next call looks (an error may be the first sign of a dead process)."""
        self._checked_at = 0.0


def process_roles(running: Sequence[Any], server_pid: int | None = None) -> dict[str, int]:
    """``{role: pid}`` by vLLM's process titles: ``APIServer`` (``server_pid``), ``EngineCore``,
    ``Worker-0``...; others by their name."""
    roles: dict[str, int] = {}
    workers = 0
    for proc in sorted(running, key=lambda p: p.pid):
        if proc.pid == server_pid:
            roles["APIServer"] = proc.pid
            continue
        try:
            title = proc.name()
        except Exception:  # exited meanwhile
            continue
        if "EngineCore" in title:
            role = "EngineCore"
        elif "Worker" in title:
            role, workers = f"Worker-{workers}", workers + 1
        else:
            role = f"{title}-{proc.pid}"
        roles[role] = proc.pid
    return roles


@attrs.frozen
class Started:
    """What a started engine tells the backend: parameter specs, model facts, capabilities."""

    specs: dict[str, TensorSpec]
    info: ModelInfo
    capabilities: Capabilities


class Transport(Protocol):
    """The engine calls of one vLLM engine (see the module docstring)."""

    #: True: the transport's requests pass the backend's LoadGate, which then knows when none is
    #: in the engine (a weight load holds new ones back instead of pausing the scheduler) and
    #: whether the prefix cache can hold anything to reset; False: always pause, and an explicit
    #: reset always resets
    gated: bool

    @property
    def kv_cache_release(self) -> bool:
        """Whether the engine can release the KV cache alone (vLLM >= 0.32); else it goes with sleep."""

    @property
    def salted(self) -> bool:
        """Whether every request reaches vLLM with the ``cache_salt`` of the weight version that
        serves it (:mod:`rlinfer_vllm.versions`), so that an update needs no prefix-cache reset;
        False (a server whose token endpoint lacks the field): every update resets the cache."""

    def prefill_pending(self) -> bool:
        """During a load: whether a request of this backend may be in the engine without its
        prompt prefilled (admitted under the old salt, it would prefill with the new weights)."""

    async def settle_prefills(self, timeout_s: float) -> None:
        """While the load gate holds new requests back and the engine still runs: wait until
        :meth:`prefill_pending` is False or ``timeout_s`` passed (returns at once where the
        transport cannot see prefills end)."""

    @property
    def multimodal(self) -> bool:
        """Whether the served model takes images (its encoder cache is reset with the prefix cache)."""

    #: the capabilities before start (refined by :meth:`start`)
    capabilities: Capabilities

    async def start(self) -> Started:
        """Start (or attach to) the engine; its specs, facts and refined capabilities."""

    def check_alive(self) -> None:
        """EngineDead when an engine process died or the transport was shut down."""

    async def check_health(self) -> None:
        """EngineDead when the engine does not answer its health check."""

    async def shutdown(self) -> None:
        """Stop every process this transport started."""

    def processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes."""

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Completions of ``requests`` (their ids in flight meanwhile)."""

    def stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Deltas of ``request`` (its id in flight meanwhile)."""

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Ask the engine to abort ``request_ids`` (one call; the backend repeats it)."""

    async def pause(self, mode: PauseMode) -> None:
        """The caller's pause in ``mode``."""

    async def resume(self) -> None:
        """The caller's resume."""

    async def pause_for_load(self) -> None:
        """Pause the scheduler in "keep" mode for a weight load."""

    async def resume_after_load(self) -> None:
        """Resume after a weight load (also after a failed or cancelled one)."""

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        """Reset the prefix cache (``reset_running``: preempting running requests); success."""

    async def reset_encoder_cache(self) -> None:
        """Drop cached image embeddings."""

    async def rpc(self, method: str, *args: Any) -> Any:
        """Call ``RLInferWorkerExtension.<method>`` in the workers; rank 0's result."""

    async def label_version(self, version: int) -> None:
        """Label the tokens of every later engine step with ``version``."""

    #: whether :meth:`rpc_at_step_boundary` works (rlinfer's engine-core plugin answered)
    loads_at_step_boundary: bool

    async def rpc_at_step_boundary(self, method: str, *args: Any, version: int) -> Any:
        """:meth:`rpc`, run by the engine core between two of its steps with the caches handled
        there; the tokens of every later step are labelled ``version`` if every rank loaded."""

    async def sleep(self, level: int) -> None:
        """vLLM's sleep mode at ``level`` (requests in flight are aborted)."""

    async def release_kv_cache(self) -> None:
        """Abort what runs and release the KV cache alone."""

    async def wake_up(self, tags: Sequence[str]) -> None:
        """Wake ``tags`` up."""

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """``rlinfer bench``'s raw baseline: tokens out of the engine's own API."""

    async def bench_raw_weight_update(self, path: str) -> None:
        """``rlinfer bench``'s raw baseline: vLLM's own reload from ``path``."""

    def parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Tool calls in ``text`` by vLLM's parser."""

    async def load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        """Load a LoRA adapter."""

    async def unload_lora(self, name: str) -> None:
        """Unload a LoRA adapter."""

    async def list_loras(self) -> Sequence[str]:
        """Names of the adapters served."""
