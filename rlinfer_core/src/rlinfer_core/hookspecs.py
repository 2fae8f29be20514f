# mypy: disable-error-code="empty-body"
"""The rlinfer contract as pluggy hook specifications.

Two kinds of hooks:

* **Operation hooks** (``firstresult=True``): implemented by exactly one backend object, which is
  registered in the engine's own :class:`pluggy.PluginManager`. Most are ``async def`` in the
  backend; the facade (:class:`rlinfer_core.engine.AsyncEngine`) awaits what they return. The
  facade validates inputs and checks capabilities *before* calling them, so a backend sees only
  well-formed requests and weight updates that match its parameters.
* **Event hooks** (``rlinfer_on_...``): for any number of observer plugins (metrics, tracing,
  parity checks), found through the entry-point group ``rlinfer.plugins``. They are called after
  the fact, return nothing and must not raise; they never branch on the backend.

pluggy validates every hookimpl's argument names against these specs at registration: the first,
static conformance gate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum
    from rlinfer_core.model_info import ModelInfo
    from rlinfer_core.types import (
        Capabilities,
        Completion,
        CompletionDelta,
        EngineConfig,
        GenerateRequest,
        MemoryTag,
        PauseMode,
    )
    from rlinfer_core.weights import BroadcastGroup, TensorSpec, WeightUpdate

PROJECT = "rlinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- lifecycle ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def rlinfer_start(config: EngineConfig) -> Awaitable[None]:
    """Start the real engine for ``config``; returns once it can serve requests.

    Runs inside the facade's event loop (engines that own asyncio tasks need it).
    Raise :class:`~rlinfer_core.errors.BackendLoadError` when the engine cannot start.
    """


@hookspec(firstresult=True)
def rlinfer_capabilities() -> Capabilities:
    """Return what this backend truly supports on the platform it runs on (sync)."""


@hookspec(firstresult=True)
def rlinfer_model_info() -> ModelInfo:
    """Return vocabulary size, context length and EOS ids of the served model (sync)."""


@hookspec(firstresult=True)
def rlinfer_check_health() -> Awaitable[None]:
    """Raise :class:`~rlinfer_core.errors.EngineDead` when the engine can no longer serve."""


@hookspec(firstresult=True)
def rlinfer_engine_processes() -> Mapping[str, int]:
    """The engine's child processes now running, as ``{role: pid}`` (e.g. ``"EngineCore"``,
    ``"Worker-0"``, ``"scheduler"``, ``"detokenizer"``); sync. The kit kills each in turn and
    expects :class:`~rlinfer_core.errors.EngineDead` from the next call."""


@hookspec(firstresult=True)
def rlinfer_shutdown() -> Awaitable[None]:
    """Stop the engine and every process it started; must be safe to call twice."""


# --- generate ----------------------------------------------------------------------------------


@hookspec(firstresult=True)
def rlinfer_generate(requests: Sequence[GenerateRequest]) -> Awaitable[list[Completion]]:
    """Run a batch to completion.

    Returns ``n`` completions per request, ordered by request, then by sample index. Each
    completion's ``logprobs`` are those of the sampled tokens in the request's
    :class:`~rlinfer_core.types.LogprobsMode`. A request aborted meanwhile returns its partial
    tokens with finish_reason ``abort``.

    ``token_versions``: the weight version that produced each token. The backend starts at
    version 0 and learns each new version from :func:`rlinfer_update_weights`
    (``update.version``); a token computed by an engine step after that update was loaded carries
    the new version. The facade derives ``weight_version`` from them.
    """


@hookspec(firstresult=True)
def rlinfer_generate_stream(request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
    """Stream one request: deltas that concatenate to what :func:`rlinfer_generate` returns."""


@hookspec(firstresult=True)
def rlinfer_abort(request_ids: Sequence[str] | None) -> Awaitable[None]:
    """Abort the given requests (``None``: all). Their callers get partial tokens, "abort"."""


@hookspec(firstresult=True)
def rlinfer_pause(mode: PauseMode) -> Awaitable[None]:
    """Pause generation; ``mode`` says what happens to in-flight requests (see PauseMode)."""


@hookspec(firstresult=True)
def rlinfer_resume() -> Awaitable[None]:
    """Resume generation after :func:`rlinfer_pause`."""


# --- weight sync -------------------------------------------------------------------------------


@hookspec(firstresult=True)
def rlinfer_weight_specs() -> Mapping[str, TensorSpec]:
    """Return the HF parameter names the engine accepts, with dtype and shape (sync).

    The facade validates every weight update against this before calling
    :func:`rlinfer_update_weights`.
    """


@hookspec(firstresult=True)
def rlinfer_update_weights(update: WeightUpdate) -> Awaitable[None]:
    """Load a validated weight update into the engine, all or nothing.

    On failure raise :class:`~rlinfer_core.errors.WeightUpdateError` with the engine still
    serving the previous weights. For a :class:`~rlinfer_core.weights.BroadcastSource` the
    backend receives the tensors and checks them (finite) before loading any. The facade bumps
    the version and resets the prefix cache after success.

    ``update.version`` is the version these weights will have (set by the facade); tokens
    produced after the load carry it in ``Completion.token_versions``.
    """


@hookspec(firstresult=True)
def rlinfer_weights_checksum() -> Awaitable[Mapping[str, WeightChecksum]]:
    """Checksums (:func:`rlinfer_core.checksum.tensor_checksum`) of every tensor the engine
    serves, computed inside the engine from its own parameters mapped back to HF names.

    The served output head is reported as ``lm_head.weight`` even when tied to the embedding
    (see ``ModelInfo.tied_weights``). Only for backends claiming ``weights.checksum``.
    """


@hookspec(firstresult=True)
def rlinfer_init_weight_broadcast(group: BroadcastGroup) -> Awaitable[None]:
    """Join the trainer's torch.distributed weight group (engine ranks 1..world_size-1)."""


# --- memory ------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def rlinfer_release_memory(tags: frozenset[MemoryTag]) -> Awaitable[None]:
    """Free the accelerator memory held for ``tags`` (weights, kv_cache)."""


@hookspec(firstresult=True)
def rlinfer_resume_memory(tags: frozenset[MemoryTag]) -> Awaitable[None]:
    """Re-allocate what :func:`rlinfer_release_memory` freed; weights come back unchanged."""


@hookspec(firstresult=True)
def rlinfer_reset_prefix_cache() -> Awaitable[None]:
    """Drop every cached prefix so that no output depends on KV computed by older weights."""


# --- benchmarking ------------------------------------------------------------------------------


@hookspec(firstresult=True)
def rlinfer_bench_raw_generate(requests: Sequence[GenerateRequest]) -> Awaitable[int]:
    """Run ``requests`` through the engine's native API on the same engine instance, bypassing
    rlinfer's conversions; return the number of generated tokens. Used by ``rlinfer bench`` to
    measure rlinfer's overhead against the raw engine."""


@hookspec(firstresult=True)
def rlinfer_bench_raw_weight_update(path: str) -> Awaitable[None]:
    """Reload weights from the safetensors directory ``path`` with the engine's own call, with no
    rlinfer validation; used by ``rlinfer bench`` as the baseline for weight-update time."""


# --- events for observer plugins ----------------------------------------------------------------


@hookspec
def rlinfer_on_engine_started(backend: str, capabilities: Capabilities, seconds: float) -> None:
    """The engine finished starting."""


@hookspec
def rlinfer_on_generate_done(
    backend: str, requests: Sequence[GenerateRequest], completions: Sequence[Completion], seconds: float
) -> None:
    """A generate batch finished (also called with the partial results of aborted requests)."""


@hookspec
def rlinfer_on_weights_updated(backend: str, version: int, transport: str, nbytes: int, seconds: float) -> None:
    """A weight update succeeded; ``version`` is the new weight version."""


@hookspec
def rlinfer_on_weight_update_failed(backend: str, transport: str, error: Exception) -> None:
    """A weight update was rejected (the old weights still serve) or failed while loading (the
    error says whether the engine may hold a partial update)."""


@hookspec
def rlinfer_on_memory_released(backend: str, tags: frozenset[MemoryTag], seconds: float) -> None:
    """Memory for ``tags`` was released."""


@hookspec
def rlinfer_on_memory_resumed(backend: str, tags: frozenset[MemoryTag], seconds: float) -> None:
    """Memory for ``tags`` was resumed."""


@hookspec
def rlinfer_on_engine_shutdown(backend: str) -> None:
    """The engine was shut down."""
