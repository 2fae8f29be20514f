"""The capability vocabulary: what a backend may or may not truly support on a platform.

Re-exported by :mod:`rlinfer_core.types` (import them from there).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from rlinfer_core.errors import UnsupportedCapability


class Capability(enum.StrEnum):
    """One thing a backend may or may not truly support on the current platform."""

    STREAM = "generate.stream"
    CHAT = "generate.chat"
    PROMPT_LOGPROBS = "generate.prompt_logprobs"
    TOP_LOGPROBS = "generate.top_logprobs"
    MULTI_SAMPLE = "generate.n"
    SEEDED_SAMPLING = "generate.seed"  #: per-request seeds reproduce sampled outputs
    STOP_STRINGS = "generate.stop_strings"
    ABORT = "abort"
    PAUSE_ABORT = "pause.abort"
    PAUSE_WAIT = "pause.wait"
    PAUSE_KEEP = "pause.keep"
    WEIGHTS_TENSORS = "weights.tensors"  #: in-process named tensors (shm / CUDA IPC under)
    WEIGHTS_BUCKETS = "weights.buckets"  #: the core's flattened per-dtype buckets
    WEIGHTS_DISK = "weights.disk"  #: a safetensors checkpoint directory
    WEIGHTS_BROADCAST = "weights.broadcast"  #: torch.distributed broadcast group
    WEIGHTS_CHECKSUM = "weights.checksum"  #: the engine reports checksums of what it serves
    MEMORY_RELEASE = "memory.release"  #: release_memory really frees accelerator memory
    #: release_memory(discard_weights=True): weights are dropped without a host backup and the
    #: next full update_weights refills them (generate is refused until then)
    MEMORY_DISCARD_WEIGHTS = "memory.discard_weights"
    #: release_memory(["cuda_graph"]): the captured CUDA graphs' memory is freed too (and is part
    #: of release_memory() without tags)
    MEMORY_CUDA_GRAPH = "memory.cuda_graph"
    #: update_weights(WeightDelta): only the tensors that changed since a given base version
    WEIGHTS_DELTA = "weights.delta"
    #: stage_weights(update) -> handle: the next weights move into the engine's own processes
    #: while generation goes on, and handle.commit() makes them live at a step boundary
    #: (:mod:`rlinfer_core.staging`)
    WEIGHTS_STAGED = "weights.staged"
    #: EngineConfig.deterministic: bitwise-identical tokens and logprobs run to run and across
    #: batch compositions (the engines' batch-invariant / deterministic modes)
    DETERMINISTIC = "generate.deterministic"
    #: SamplingParams.return_routed_experts: Completion.routed_experts of an MoE model, in the one
    #: alignment of :mod:`rlinfer_core.routing` (needs EngineConfig.enable_routed_experts)
    GENERATE_ROUTED_EXPERTS = "generate.routed_experts"
    #: SamplingParams.return_hidden_states: Completion.hidden_states (and prompt_hidden_states), the
    #: final-layer states of :mod:`rlinfer_core.hidden_states` (needs EngineConfig.enable_hidden_states)
    GENERATE_HIDDEN_STATES = "generate.hidden_states"
    PREFIX_CACHE_RESET = "prefix_cache.reset"
    SAMPLING_MIN_P = "sampling.min_p"
    SAMPLING_PENALTIES = "sampling.penalties"  #: repetition, presence and frequency penalties
    SAMPLING_LOGIT_BIAS = "sampling.logit_bias"  #: per-token bias and allowed_token_ids
    LOGPROBS_RAW = "logprobs.raw"  #: logprobs_mode="raw"
    #: logprobs_mode="processed" under truncation (top_p, top_k, min_p): renormalised over the
    #: tokens that could be sampled
    LOGPROBS_PROCESSED = "logprobs.processed"
    #: the raw-engine baselines of ``rlinfer bench`` (:class:`rlinfer_core.backend.BenchBackend`);
    #: optional, not part of serving
    BENCH = "bench"
    #: multi-turn episodes with token continuity (:mod:`rlinfer_core.session`); derived by the
    #: facade from plain generate (:mod:`rlinfer_core.derived`)
    SESSIONS = "sessions"
    #: teacher-forced logprobs of given tokens (:mod:`rlinfer_core.scoring`); derived by the
    #: facade from generate.prompt_logprobs
    SCORE = "score"
    #: tools on requests (chat template tool section) and parsed tool calls (:mod:`rlinfer_core.tools`)
    TOOLS = "generate.tools"
    #: JSON schema / regex / choice constraints (:mod:`rlinfer_core.structured`)
    STRUCTURED = "generate.structured"
    #: SamplingParams.stop_regex: stop at the first match of a regular expression in the output
    STOP_REGEX = "generate.stop_regex"
    #: StructuredOutput.ebnf: an EBNF (GBNF) grammar constraint, beside generate.structured
    GRAMMAR_EBNF = "generate.grammar_ebnf"
    #: GenerateRequest.priority other than 0: requests queue by priority (lower first)
    PRIORITY = "generate.priority"
    #: LoRA adapters: load, unload, update in place, per-request use (:mod:`rlinfer_core.lora`)
    LORA = "lora"
    #: an engine started quantized online (``engine_kwargs={"quantization": "fp8"}``) on a
    #: BF16/FP16 checkpoint takes update_weights in the checkpoint's names, shapes and dtypes (what
    #: a BF16 trainer holds) and serves them re-quantized by the engine's own online quantization.
    #: weight_specs stay the checkpoint's; bit-exact weights.checksum cannot hold (the engine
    #: serves FP8 values and scales), so an update is checked by names/shapes/dtypes and
    #: finiteness, and the served FP8 weights against the sent ones within FP8's rounding
    #: (:mod:`rlinfer_core.quantized`) where the backend can read them back
    WEIGHTS_QUANTIZED_RELOAD = "weights.quantized_reload"
    #: images in requests (GenerateRequest.images, image parts of chat messages) for a
    #: vision-language model; the completion's prompt ids are expanded exactly once and carry
    #: Completion.multimodal (:mod:`rlinfer_core.multimodal`). Notes say which modalities
    MULTIMODAL = "generate.multimodal"


def _capability_set(value: Any) -> frozenset[Capability]:
    return frozenset(Capability(c) for c in value)


@attrs.frozen
class Capabilities:
    """What a backend truly supports on the platform it runs on.

    ``notes`` explains, per capability, why it is missing or how it behaves (shown by
    ``rlinfer backends``). Built once per backend+platform.
    """

    backend: str
    engine_version: str
    platform: str  #: "cpu" or "cuda"
    supported: frozenset[Capability] = attrs.field(converter=_capability_set)
    notes: Mapping[str, str] = attrs.field(factory=dict)

    def supports(self, capability: Capability) -> bool:
        """True when ``capability`` is supported."""
        return capability in self.supported

    def require(self, capability: Capability) -> None:
        """Raise UnsupportedCapability unless ``capability`` is supported."""
        if capability not in self.supported:
            raise UnsupportedCapability(capability.value, self.backend, self.notes.get(capability.value, ""))

    def without(self, reasons: Mapping[Capability, str]) -> Capabilities:
        """A copy that no longer claims the supported capabilities among ``reasons``, each noted
        with its reason (what a running engine's configuration turns off)."""
        dropped = {c for c in reasons if c in self.supported}
        if not dropped:
            return self
        notes = {**self.notes, **{c.value: reasons[c] for c in dropped}}
        return attrs.evolve(self, supported=self.supported - dropped, notes=notes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "backend": self.backend,
            "engine_version": self.engine_version,
            "platform": self.platform,
            "supported": sorted(c.value for c in self.supported),
            "unsupported": sorted(c.value for c in Capability if c not in self.supported),
            "notes": dict(self.notes),
        }
