# mypy: disable-error-code="empty-body"
"""The rlinfer contract as pluggy hook specifications.

Two kinds of hooks:

* **Operation hooks** (``firstresult=True``): implemented by exactly one backend object, which is
  registered in the engine's own :class:`pluggy.PluginManager`. Most are ``async def`` in the
  backend; the facade (:class:`rlinfer_core.engine.AsyncEngine`) awaits what they return. The
  facade validates inputs and checks capabilities *before* calling them, so a backend sees only
  well-formed requests and weight updates that match its parameters.
  A hook marked :func:`optional` backs the capabilities it names: a backend implements it only
  where it claims one of them, and the facade refuses at open a backend that claims one without
  the hook. :mod:`rlinfer_core.backend` is the typed view of these hooks for mypy and the facade
  (:class:`~rlinfer_core.backend.Backend`: the unmarked hooks; one protocol per optional group);
  it restates nothing (its members take their docstrings from here) and
  ``tests/core/test_contract_stated_once.py`` checks it against these specs mechanically.
* **Event hooks** (``rlinfer_on_...``): for any number of observer plugins (metrics, tracing,
  parity checks), found through the entry-point group ``rlinfer.plugins``. They are called after
  the fact, return nothing and must not raise; they never branch on the backend.

pluggy validates every hookimpl's argument names against these specs at registration: the first,
static conformance gate.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import pluggy

from rlinfer_core.capability import Capability

if TYPE_CHECKING:
    from rlinfer_core.checksum import WeightChecksum
    from rlinfer_core.lora import LoraAdapter
    from rlinfer_core.model_info import ModelInfo
    from rlinfer_core.tools import ToolCalls, ToolSpec
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


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for this project's hooks. It looks for hook implementations without
    running properties, as pluggy >= 1.6 does: older versions ``getattr`` every attribute of a
    plugin at registration, so a property that raises until its plugin has started (the pool's
    replicas) made registering it fail."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.add_hookspecs(sys.modules[__name__])

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        """pluggy's, except that properties are never hook implementations (nor evaluated)."""
        if isinstance(inspect.getattr_static(plugin, name, None), property):
            return None
        return super().parse_hookimpl_opts(plugin, name)


#: the attribute :func:`optional` sets on a hookspec: the capabilities the hook backs
OPTIONAL_MARK = "rlinfer_optional"
_Spec = TypeVar("_Spec", bound=Callable[..., object])


def optional(*capabilities: Capability) -> Callable[[_Spec], _Spec]:
    """Mark an operation hook optional: a backend implements it where it claims one of
    ``capabilities``; elsewhere the facade raises UnsupportedCapability before reaching it. With
    no capability the hook is optional outright (the facade refuses only the call that needs it)."""

    def mark(spec: _Spec) -> _Spec:
        setattr(spec, OPTIONAL_MARK, frozenset(capabilities))
        return spec

    return mark


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


@optional()
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


@optional(Capability.STREAM)
@hookspec(firstresult=True)
def rlinfer_generate_stream(request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
    """Stream one request: deltas that concatenate to what :func:`rlinfer_generate` returns."""


@optional(Capability.ABORT, Capability.PAUSE_ABORT)
@hookspec(firstresult=True)
def rlinfer_abort(request_ids: Sequence[str] | None) -> Awaitable[None]:
    """Abort the given requests (``None``: all). Their callers get partial tokens, "abort"."""


@optional(Capability.PAUSE_ABORT, Capability.PAUSE_WAIT, Capability.PAUSE_KEEP)
@hookspec(firstresult=True)
def rlinfer_pause(mode: PauseMode) -> Awaitable[None]:
    """Pause generation; ``mode`` says what happens to in-flight requests (see PauseMode)."""


@optional(Capability.PAUSE_ABORT, Capability.PAUSE_WAIT, Capability.PAUSE_KEEP)
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
    the version and resets the prefix cache after success, unless the backend states
    ``update_invalidates_prefixes = True``: then its update leaves no prefix computed by older
    weights reachable by later requests itself.

    The facade validates names, shapes, dtypes and values first, except the values of
    :class:`~rlinfer_core.weights.NamedTensors` on CUDA where the backend states
    ``checks_cuda_tensor_values = True``: it then packs them with
    ``rlinfer_core.transfer.ipc.pack_cuda(..., check_values=True)`` (which raises
    WeightUpdateError for NaN or inf) before anything loads, here and in
    :func:`rlinfer_stage_weights`.

    ``update.version`` is the version these weights will have (set by the facade); tokens
    produced after the load carry it in ``Completion.token_versions``.
    """


@optional(Capability.WEIGHTS_CHECKSUM)
@hookspec(firstresult=True)
def rlinfer_weights_checksum() -> Awaitable[Mapping[str, WeightChecksum]]:
    """Checksums (:func:`rlinfer_core.checksum.tensor_checksum`) of every tensor the engine
    serves, computed inside the engine from its own parameters mapped back to HF names.

    The served output head is reported as ``lm_head.weight`` even when tied to the embedding
    (see ``ModelInfo.tied_weights``). Only for backends claiming ``weights.checksum``.
    """


@optional(Capability.WEIGHTS_BROADCAST)
@hookspec(firstresult=True)
def rlinfer_init_weight_broadcast(group: BroadcastGroup) -> Awaitable[None]:
    """Join the trainer's torch.distributed weight group (engine ranks 1..world_size-1)."""


# --- staged weight updates (optional: only for backends claiming Capability.WEIGHTS_STAGED) ------


@optional(Capability.WEIGHTS_STAGED)
@hookspec(firstresult=True)
def rlinfer_stage_weights(staging_id: str, update: WeightUpdate) -> Awaitable[None]:
    """Move a validated update into engine-side staging under ``staging_id``, without touching
    the live weights and without pausing generation.

    The tensors must end up held by the engine's own processes (the caller may free or change
    its buffers once this returns): staging that only keeps references in the caller is not
    staging. Called once or more per ``staging_id`` (buckets; the facade refuses a name staged
    twice); raise :class:`~rlinfer_core.errors.WeightUpdateError` when the engine refuses the
    tensors, with nothing of this call staged.
    """


@optional(Capability.WEIGHTS_STAGED)
@hookspec(firstresult=True)
def rlinfer_commit_staged_weights(staging_id: str, version: int) -> Awaitable[None]:
    """Load everything staged under ``staging_id`` as one update, all or nothing, at a step
    boundary (as :func:`rlinfer_update_weights` loads), then drop the staged tensors.
    ``version``: the version the weights get; tokens computed after the load carry it."""


@optional(Capability.WEIGHTS_STAGED)
@hookspec(firstresult=True)
def rlinfer_cancel_staged_weights(staging_id: str) -> Awaitable[None]:
    """Drop what is staged under ``staging_id`` (nothing staged: nothing to do); the live
    weights are untouched."""


# --- memory ------------------------------------------------------------------------------------


@optional(Capability.MEMORY_RELEASE)
@hookspec(firstresult=True)
def rlinfer_release_memory(tags: frozenset[MemoryTag], discard_weights: bool = False) -> Awaitable[None]:
    """Free the accelerator memory held for ``tags`` (weights, kv_cache).

    ``discard_weights=True`` (only for backends claiming ``memory.discard_weights``; the facade
    passes it only then, and ``tags`` holds weights): drop the weights without a host backup;
    after resume their memory may hold garbage, and the facade refuses generation until a full
    :func:`rlinfer_update_weights` has loaded. The facade calls the hook without the argument for
    a plain release, so a backend without discard support may leave it out of its signature;
    the real backends take it with a default of False and refuse True where not supported.
    """


@optional(Capability.MEMORY_RELEASE)
@hookspec(firstresult=True)
def rlinfer_resume_memory(tags: frozenset[MemoryTag]) -> Awaitable[None]:
    """Re-allocate what :func:`rlinfer_release_memory` freed; weights come back unchanged
    (after a discarding release: their memory only, to be filled by a full weight update)."""


@optional(Capability.PREFIX_CACHE_RESET)
@hookspec(firstresult=True)
def rlinfer_reset_prefix_cache() -> Awaitable[None]:
    """Drop every cached prefix so that no output depends on KV computed by older weights."""


# --- benchmarking (optional: only for backends claiming Capability.BENCH) ----------------------


@optional(Capability.BENCH)
@hookspec(firstresult=True)
def rlinfer_bench_raw_generate(requests: Sequence[GenerateRequest]) -> Awaitable[int]:
    """Run ``requests`` through the engine's native API on the same engine instance, bypassing
    rlinfer's conversions; return the number of generated tokens. Used by ``rlinfer bench`` to
    measure rlinfer's overhead against the raw engine."""


@optional(Capability.BENCH)
@hookspec(firstresult=True)
def rlinfer_bench_raw_weight_update(path: str) -> Awaitable[None]:
    """Reload weights from the safetensors directory ``path`` with the engine's own call, with no
    rlinfer validation; used by ``rlinfer bench`` as the baseline for weight-update time."""


# --- agent rollouts (issue 13; each optional, behind its capability) ----------------------------
#
# Sessions (capability ``sessions``) and scoring (``score``) need no hook: the facade builds them on
# rlinfer_generate (rlinfer_core.session, rlinfer_core.scoring, rlinfer_core.agent).
#
# Structured output (``generate.structured``) needs no hook either: ``request.sampling.structured``
# (rlinfer_core.structured.StructuredOutput: kind json_schema | regex | choice, value already
# validated) reaches rlinfer_generate / rlinfer_generate_stream; the backend hands it to its
# engine's grammar backend and every output must parse / match in full. Under a constraint,
# logprobs_mode "processed" includes the grammar mask (forbidden tokens have probability 0, the
# rest renormalised, like allowed_token_ids); "raw" is log_softmax of the model's logits.
#
# Tools (``generate.tools``): for ``messages`` requests rlinfer_generate renders the chat template
# with ``tools=[t.to_openai() for t in request.tools]`` (the template's tool section), exactly as
# ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True)`` does. Parsing
# is rlinfer_parse_tool_calls below; the facade calls it on the decoded output of every request
# with a ``tool_parser`` and sets ``Completion.tool_calls``.
#
# LoRA (``lora``): ``request.lora`` names a loaded adapter for rlinfer_generate /
# rlinfer_generate_stream (the facade has checked it is loaded); None means the base weights.


@optional(Capability.TOOLS)
@hookspec(firstresult=True)
def rlinfer_parse_tool_calls(text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
    """Parse tool calls in generated ``text`` with the **engine's own** parser (sync).

    ``parser`` is a contract name (:data:`rlinfer_core.tools.TOOL_PARSERS`): "hermes", "qwen" or
    "llama"; the backend maps it onto its engine's parser. Return a
    :class:`~rlinfer_core.tools.ToolCalls` with one :class:`~rlinfer_core.tools.ToolCall` per call
    in order (``name``, ``arguments`` as a dict, ``arguments_json``, ``raw`` = the call's text) and
    ``content`` = the text outside the calls. Never raise for bad model output: a call the parser
    cannot read (broken JSON, missing name, an unterminated call) is a ToolCall with ``error`` set
    and ``raw`` holding its text. Engine parsers that swallow errors (returning no calls although
    the text holds a call marker) must be detected and reported that way. The facade marks calls
    of unknown tools and schema-invalid arguments itself.
    """


@optional(Capability.LORA)
@hookspec(firstresult=True)
def rlinfer_load_lora(adapter: LoraAdapter, replace: bool) -> Awaitable[None]:
    """Load LoRA ``adapter`` (a PEFT directory ``adapter.path``, or ``adapter.tensors`` with the
    PEFT config ``adapter.config``) under ``adapter.name``.

    ``replace=False``: a new adapter. ``replace=True``: update the loaded adapter of that name in
    place (same rank and target modules, checked by the facade): requests admitted after this
    returns use the new weights, and no prefix-cache entry computed with the old weights is
    reused. Raise :class:`~rlinfer_core.errors.InvalidRequest` (field ``lora``) when the engine
    rejects the adapter (e.g. rank above its maximum); the engine keeps what it served before.
    """


@optional(Capability.LORA)
@hookspec(firstresult=True)
def rlinfer_unload_lora(name: str) -> Awaitable[None]:
    """Unload the adapter ``name`` (the facade checked it is loaded)."""


@optional(Capability.LORA)
@hookspec(firstresult=True)
def rlinfer_list_loras() -> Awaitable[Sequence[str]]:
    """Names of the adapters the engine holds now (the facade checks them against its registry)."""


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
