"""What the SGLang backend truly supports, per platform. Imports no engine.

SGLang ships one distribution (``sglang``); whether it runs on CPU or CUDA depends on the machine
and on ``SGLANG_USE_CPU_ENGINE``. :func:`installed_platform` decides cheaply (no torch import):
CUDA when an NVIDIA driver is visible and the CPU engine is not forced, CPU otherwise. The
backend re-checks at start against the device the engine was really given.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path
from typing import Literal

from rlinfer_core import parallel
from rlinfer_core.types import Capabilities, Capability

BACKEND = "sglang"

#: supported engine versions (PEP 508); 0.5.16 is the oldest verified on GPU, 0.5.23 on CPU
ENGINE_REQUIREMENTS: tuple[str, ...] = ("sglang>=0.5.16,<0.6",)

Platform = Literal["cpu", "cuda"]

#: supported on every platform the backend runs on
COMMON: frozenset[Capability] = frozenset(
    {
        Capability.STREAM,
        Capability.CHAT,
        Capability.PROMPT_LOGPROBS,
        Capability.TOP_LOGPROBS,
        Capability.MULTI_SAMPLE,
        Capability.STOP_STRINGS,
        Capability.ABORT,
        Capability.PAUSE_ABORT,
        Capability.PAUSE_WAIT,
        Capability.PAUSE_KEEP,
        Capability.WEIGHTS_TENSORS,
        Capability.WEIGHTS_BUCKETS,
        Capability.WEIGHTS_DISK,
        Capability.WEIGHTS_BROADCAST,
        Capability.PREFIX_CACHE_RESET,
        Capability.BENCH,
        Capability.TOOLS,  # rlinfer_sglang.agent: SGLang's FunctionCallParser, pure Python
        Capability.STOP_REGEX,  # SGLang's stop_regex: Python re over the decoded tail, in the scheduler
        Capability.PRIORITY,  # dropped at start unless the engine runs priority scheduling
    }
)

#: verified on CPU (rlinfer_sglang.agent); on CUDA SGLang applies the grammar mask with its
#: triton kernel instead of xgrammar's CPU one (not verified yet)
AGENT_CPU: frozenset[Capability] = frozenset({Capability.STRUCTURED, Capability.GRAMMAR_EBNF})

AGENT_NOTES = {
    Capability.TOOLS.value: (
        "SGLang's FunctionCallParser (hermes -> hermes, qwen -> qwen25, llama -> llama3), one call "
        "segment at a time so that a malformed call is reported on its own"
    ),
    Capability.STRUCTURED.value: (
        "SGLang's json_schema / regex sampling params (choice as a regex) through its xgrammar "
        "backend; processed logprobs include the grammar mask; JSON is generated compact"
    ),
    Capability.GRAMMAR_EBNF.value: "SGLang's ebnf sampling param through its xgrammar backend (GBNF dialect)",
    Capability.STOP_REGEX.value: (
        "SGLang's stop_regex (Python re.search over the decoded output tail each step); rlinfer cuts "
        "Completion.text at the match"
    ),
    Capability.PRIORITY.value: (
        "SGLang's priority scheduling (--enable-priority-scheduling; rlinfer's lower-first values are "
        "negated for SGLang's default higher-first order); higher priorities may preempt running requests"
    ),
}

#: why generate.priority is not claimed by an engine started without priority scheduling
PRIORITY_OFF_NOTE = (
    "the engine was started without priority scheduling (SGLang aborts a request that names a priority "
    "then); open it with EngineConfig(priority_scheduling=True)"
)

#: verified against an HF fp32 oracle on CPU (1e-5); on CUDA the sampler takes other kernels
#: (flashinfer), not verified yet
SAMPLING: frozenset[Capability] = frozenset(
    {
        Capability.SAMPLING_MIN_P,
        Capability.SAMPLING_PENALTIES,
        Capability.SAMPLING_LOGIT_BIAS,
        Capability.LOGPROBS_RAW,
        Capability.LOGPROBS_PROCESSED,
    }
)

SAMPLING_NOTES = {
    Capability.SAMPLING_MIN_P.value: "SGLang's min_p",
    Capability.SAMPLING_PENALTIES.value: (
        "rlinfer's logits processor in SGLang's sampler (SGLang's own repetition penalty ignores the "
        "prompt); exact only without SGLang's overlap scheduler (off on CPU)"
    ),
    Capability.SAMPLING_LOGIT_BIAS.value: "rlinfer's logits processor in SGLang's sampler",
    Capability.LOGPROBS_RAW.value: (
        "one extra prefill scores prompt + output (SGLang reports output logprobs after processing); "
        "computed by the weights serving when the sample ends"
    ),
    Capability.LOGPROBS_PROCESSED.value: (
        "under top_k/top_p/min_p from SGLang's sampling mask (the sampled token's probability over "
        "the support it was sampled from); SGLang applies top_p to the distribution before top_k "
        "renormalisation (joint), which differs from vLLM's sequential order when both are set"
    ),
    Capability.WEIGHTS_CHECKSUM.value: (
        "computed in the scheduler from model.named_parameters(), fused qkv/gate_up sliced back; "
        "tensor_parallel_size=1 only (shards are not gathered)"
    ),
    Capability.WEIGHTS_STAGED.value: (
        "not claimed (in process and server mode): SGLang's only channel that carries tensors into the "
        "scheduler, update_weights_from_tensor, takes the tokenizer manager's model-update writer lock (it "
        "waits for every request in flight) unless generation is paused, and opens a weight-update session "
        "(begin_weight_update restores in-place-packed weights); staging through it would stall generation"
    ),
}

CUDA_UNVERIFIED = "verified on CPU only; on CUDA SGLang samples with other kernels (not verified yet)"

PAUSE_KEEP_OLD_SGLANG_NOTE = (
    "this SGLang (no begin/end_weight_update, e.g. 0.5.16) refuses to flush its cache while pause(keep) "
    "holds requests, and a weight update must flush it: measured on an H100 (the flush fails, and "
    "SGLang's own post-update flush assertion kills the scheduler); use pause(wait) or pause(abort)"
)

OVERLAP_NOTE = (
    "SGLang's overlap scheduler is on: rlinfer's penalties would read output ids one token late; "
    "start with engine_kwargs={'disable_overlap_schedule': True}"
)

SEED_NOTE = (
    "SGLang ignores per-request sampling seeds unless deterministic inference is enabled; the "
    "engine-wide EngineConfig.seed (random_seed) still makes a fresh engine reproducible"
)
PAUSE_NOTES = {
    Capability.PAUSE_ABORT.value: "SGLang pause_generation(mode='abort')",
    Capability.PAUSE_WAIT.value: (
        "done by rlinfer: new requests are held back and pause returns once in-flight ones finished "
        "(SGLang has no such mode)"
    ),
    Capability.PAUSE_KEEP.value: (
        "SGLang pause_generation(mode='retract'): in-flight requests keep their tokens, their KV "
        "is recomputed at resume (with the weights loaded by then); 'in_place' is not used because "
        "SGLang cannot flush the cache while in-place-paused requests hold it"
    ),
}

DISCARD_CPU_NOTE = "needs memory.release, which SGLang on CPU does not do (see its note)"
DISCARD_CUDA_NOTE = (
    "SGLang decides the weights' host backup once, at start (torch_memory_saver region "
    "enable_cpu_backup from --enable-weights-cpu-backup, which rlinfer turns on so that a plain "
    "release keeps the weights); release_memory_occupation has no per-call discard"
)

DETERMINISTIC_CPU_NOTE = (
    "SGLang's deterministic inference needs one of its batch-invariant attention backends (fa3, fa4, "
    "flashinfer, triton, ...); its CPU backends (torch_native, intel_amx) are not among them"
)
DETERMINISTIC_CUDA_NOTE = (
    "not claimed: EngineConfig.deterministic starts SGLang with --enable-deterministic-inference, but the "
    "kit's bitwise check failed on an H100 (SGLang 0.5.16, attention_backend triton, eager): a request gave "
    "the same tokens and logprobs run to run, but other logprobs when more requests shared its batch. "
    "SGLang's sampler picks the logprob formula by batch: log_softmax(logits) when every request in the "
    "batch is greedy, log(softmax(logits / T)) when any samples (sglang/srt/layers/sampler.py, "
    "Sampler.forward), so a greedy request's logprobs depend on its neighbours"
)

ROUTES_CPU_NOTE = (
    "SGLang's routed-experts capture (--enable-return-routed-experts, per request return_routed_experts); "
    "needs EngineConfig(enable_routed_experts=True) and an MoE model. On CPU rlinfer allocates SGLang's "
    "host routing buffer unpinned in the scheduler (SGLang pins it with cudaHostRegister, which CPU "
    "torch lacks: rlinfer_sglang.scheduler.cpu_routes)"
)
ROUTES_CUDA_NOTE = (
    "not claimed: SGLang's capture is mapped (EngineConfig.enable_routed_experts), but the kit's "
    "routing test has not run on a GPU"
)
ROUTES_OFF_NOTE = (
    "the engine was started without routed-experts capture: open it with "
    "EngineConfig(enable_routed_experts=True) on an MoE model"
)

HIDDEN_STATES_NOTE = (
    "SGLang's hidden-state output (--enable-return-hidden-states, per request return_hidden_states): the "
    "final-norm output that feeds the LM head; needs EngineConfig(enable_hidden_states=True). A request "
    "asking for prompt_hidden_states is prefilled whole (no prefix-cache hit), as SGLang reports states "
    "only for the positions it computes"
)
HIDDEN_STATES_CUDA_NOTE = (
    f"not claimed: mapped, but the kit's hidden-states test has not run on a GPU; {HIDDEN_STATES_NOTE}"
)
HIDDEN_STATES_OFF_NOTE = (
    "the engine was started without hidden-state output: open it with EngineConfig(enable_hidden_states=True)"
)

CPU_NOTES = {
    Capability.GENERATE_HIDDEN_STATES.value: HIDDEN_STATES_NOTE,
    Capability.GENERATE_ROUTED_EXPERTS.value: ROUTES_CPU_NOTE,
    Capability.DETERMINISTIC.value: DETERMINISTIC_CPU_NOTE,
    Capability.MEMORY_RELEASE.value: (
        "SGLang on CPU frees nothing: release/resume_memory_occupation run but keep every byte, "
        "and its memory saver needs CUDA; use a GPU to release memory"
    ),
    Capability.SEEDED_SAMPLING.value: SEED_NOTE,
    Capability.WEIGHTS_TENSORS.value: "named tensors reach the scheduler through shared memory",
    Capability.WEIGHTS_BROADCAST.value: "gloo group; the scheduler receives, checks finiteness, then loads",
    Capability.MEMORY_DISCARD_WEIGHTS.value: DISCARD_CPU_NOTE,
    **PAUSE_NOTES,
}

CUDA_NOTES = {
    Capability.GENERATE_HIDDEN_STATES.value: HIDDEN_STATES_CUDA_NOTE,
    Capability.GENERATE_ROUTED_EXPERTS.value: ROUTES_CUDA_NOTE,
    Capability.DETERMINISTIC.value: DETERMINISTIC_CUDA_NOTE,
    Capability.MEMORY_RELEASE.value: (
        "SGLang torch_memory_saver (weights backed up to a pinned host buffer that is kept between "
        "releases, TMS_RETAIN_CPU_BACKUP=1; KV cache discarded); needs EngineConfig(enable_memory_release=True) "
        "at start"
    ),
    Capability.SEEDED_SAMPLING.value: SEED_NOTE,
    Capability.WEIGHTS_TENSORS.value: "named tensors reach the scheduler as CUDA IPC handles",
    Capability.WEIGHTS_BROADCAST.value: "NCCL group; the scheduler receives, checks finiteness, then loads",
    Capability.MEMORY_DISCARD_WEIGHTS.value: DISCARD_CUDA_NOTE,
    **PAUSE_NOTES,
}

LORA_CPU_NOTE = (
    "SGLang cannot serve LoRA on CPU: its LoRA layers allocate pinned host tensors unconditionally "
    "(sglang/srt/lora/layers.py: torch.tensor(..., pin_memory=True); lora.py pins adapter weights), "
    "which torch refuses without an accelerator, so an engine started with enable_lora=True dies at "
    "start (measured with sglang 0.5.23, lora_backend=torch_native)"
)
LORA_CUDA_NOTE = (
    "SGLang's dynamic LoRA (load/unload by name, lora_path per request); each update is a new "
    "adapter <name>.v<version>, the old one unloaded once unused"
)
LORA_OFF_NOTE = (
    "the engine was started without LoRA; open it with engine_kwargs enable_lora=True, max_lora_rank >= "
    "the adapters' rank and lora_target_modules (e.g. 'all')"
)

#: FP8 rollout from BF16 training (rlinfer_sglang.scheduler.requantize)
QUANTIZED_RELOAD_CPU_NOTE = (
    "SGLang's FP8 linear method needs AMX on CPU: sglang 0.5.23 started with quantization='fp8' dies while "
    "loading (fp8.py process_weights_after_loading: 'Fp8LinearMethod on CPU requires that CPU has AMX support'; "
    "measured here); such an engine is refused before it starts"
)
QUANTIZED_RELOAD_CUDA_NOTE = (
    "engine_kwargs quantization='fp8' on a BF16 checkpoint: SGLang quantizes online at start but never again "
    "(update_weights_from_tensor loads into the FP8 parameters); rlinfer's scheduler-side loader gives each FP8 "
    "linear layer a BF16 weight with its loader, loads the update, re-runs SGLang's FP8 quantization and copies "
    "the new codes and scales into the served tensors (rlinfer_sglang.scheduler.requantize); where verified (TP 1, "
    "Llama/Qwen2/Qwen3, per-channel FP8 on cutlass, every fused layer given whole) the update is quantized straight "
    "into the served codes with SGLang's own op instead (rlinfer_sglang.scheduler.fp8_load). weight_specs are the "
    "checkpoint's; weights.checksum is not claimed on CUDA; block FP8, FP8 checkpoints and FP8 MoE are refused"
)

CUDA_GRAPH_NOTE = (
    "not claimed: SGLang captures its CUDA graphs in the memory saver's cuda_graph region and accepts "
    "release_memory_occupation(tags=['cuda_graph']), but on an H200 with SGLang 0.5.16 it freed 0 MiB "
    "(torch.cuda.mem_get_info around it; a 0.6B model with graphs up to batch 128, and the kit's model; "
    "kv_cache freed 41 GiB and weights 1.2 GiB in the same run: dev/gpu/bench/memory_tag_probe.py, "
    "bench/results/gpu-h200-2026-11-26-session12)"
)
CUDA_GRAPH_CPU_NOTE = "no CUDA graphs on CPU"

MEMORY_RELEASE_OFF_NOTE = (
    "the engine was started without the memory saver; open it with "
    "EngineConfig(enable_memory_release=True) to release memory"
)


#: parallel features (rlinfer_core.parallel) the SGLang backend cannot run, per platform, and why
PIPELINE_NOTE = (
    "not supported: rlinfer's scheduler-side loader, checksums and broadcast receivers run on the "
    "tensor-parallel ranks of one pipeline stage and have not been built for stages (verl refuses "
    "SGLang rollouts with pipeline_model_parallel_size > 1 too)"
)
UNVERIFIED_CPU_NOTE = (
    "not supported on CPU: rlinfer has not run SGLang's CPU engine (torch_native attention) with "
    "attention data parallelism or expert parallelism through the kit, and claims nothing unverified"
)
DATA_CUDA_NOTE = (
    "data_parallel_size = D starts SGLang with tp_size = tensor_parallel_size x D and attention data "
    "parallelism of width D (attn_dp_size, or dp_size + enable_dp_attention before SGLang 0.5.23), as "
    "verl does; the broadcast group gets tensor x data parallel ranks; not yet run through the kit on a GPU"
)
EXPERT_CUDA_NOTE = (
    "expert_parallel_size = tensor x data parallel size starts SGLang with ep_size of that width; "
    "not yet run through the kit on a GPU"
)
PARALLEL_UNSUPPORTED: dict[Platform, dict[str, str]] = {
    "cpu": {parallel.EXPERT: UNVERIFIED_CPU_NOTE, parallel.DATA: UNVERIFIED_CPU_NOTE, parallel.PIPELINE: PIPELINE_NOTE},
    "cuda": {parallel.PIPELINE: PIPELINE_NOTE},
}
PARALLEL_NOTES: dict[Platform, dict[str, str]] = {
    "cpu": PARALLEL_UNSUPPORTED["cpu"],
    "cuda": {**PARALLEL_UNSUPPORTED["cuda"], parallel.DATA: DATA_CUDA_NOTE, parallel.EXPERT: EXPERT_CUDA_NOTE},
}


MULTIMODAL_NOTE = (
    "images (GenerateRequest.images, image parts of chat messages) as SGLang's image_data beside input_ids "
    "holding one image token per image, expanded by SGLang's multimodal processor (rlinfer_sglang.images); "
    "Qwen2-VL layout verified (the kit's tiny VLM); no video or audio; raw logprobs are not claimed with "
    "images (scored by a text-only prefill). On CPU it needs the sgl_kernel shim's operator stubs "
    "(dev/envs/cpu_support): SGLang 0.5.23's Qwen-VL processor imports Qwen3.5's model module, which looks "
    "up torch.ops.sgl_kernel.fused_sigmoid_mul_cpu at import"
)
MULTIMODAL_CUDA_NOTE = (
    f"not claimed: mapped as on CPU, but the kit's multimodal tests have not run on a GPU; {MULTIMODAL_NOTE}"
)
MULTIMODAL_TEXT_NOTE = "the served model is text-only (its config.json names no image_token_id)"


def multimodal_off(model: str) -> dict[Capability, str]:
    """``generate.multimodal`` to drop, with its reason, for an engine serving ``model``."""
    from rlinfer_core.multimodal import image_token_id

    return {} if image_token_id(model) is not None else {Capability.MULTIMODAL: MULTIMODAL_TEXT_NOTE}


def installed_version() -> str | None:
    """Version of the installed ``sglang`` distribution, or None."""
    try:
        return md.version("sglang")
    except md.PackageNotFoundError:
        return None


def installed_platform() -> Platform:
    """The platform SGLang would run on here, decided without importing torch or SGLang."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        return "cpu"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    return "cuda" if Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists() else "cpu"


def capabilities(
    platform: Platform,
    engine_version: str,
    memory_release: bool | None = None,
    tensor_parallel_size: int = 1,
    lora: bool | None = None,
) -> Capabilities:
    """Capabilities on ``platform``.

    ``memory_release``: whether the running engine was started with the memory saver; ``lora``:
    with LoRA enabled; None (as in :func:`describe`) reports what the platform can do.
    ``tensor_parallel_size``: the engine's ranks (EngineConfig.world_size; checksums need one).
    """
    if platform == "cpu":
        supported_cpu = set(COMMON | SAMPLING | AGENT_CPU) | {
            Capability.GENERATE_ROUTED_EXPERTS,
            Capability.GENERATE_HIDDEN_STATES,
            Capability.MULTIMODAL,
        }
        if tensor_parallel_size == 1:
            supported_cpu.add(Capability.WEIGHTS_CHECKSUM)
        notes_cpu = {
            **CPU_NOTES,
            **SAMPLING_NOTES,
            **AGENT_NOTES,
            **PARALLEL_NOTES["cpu"],
            Capability.LORA.value: LORA_CPU_NOTE,
            Capability.MULTIMODAL.value: MULTIMODAL_NOTE,
            Capability.MEMORY_CUDA_GRAPH.value: CUDA_GRAPH_CPU_NOTE,
            Capability.WEIGHTS_QUANTIZED_RELOAD.value: QUANTIZED_RELOAD_CPU_NOTE,
        }
        return Capabilities(BACKEND, engine_version, "cpu", frozenset(supported_cpu), notes_cpu)
    notes = {
        **CUDA_NOTES,
        **SAMPLING_NOTES,
        **AGENT_NOTES,
        **PARALLEL_NOTES["cuda"],
        Capability.LORA.value: LORA_CUDA_NOTE if lora is not False else LORA_OFF_NOTE,
        Capability.MULTIMODAL.value: MULTIMODAL_CUDA_NOTE,
    }
    for capability in (*SAMPLING, *AGENT_CPU, Capability.WEIGHTS_CHECKSUM):
        notes[capability.value] = f"{CUDA_UNVERIFIED}; on CPU: {notes[capability.value]}"
    supported = set(COMMON) | {Capability.WEIGHTS_QUANTIZED_RELOAD}
    notes[Capability.WEIGHTS_QUANTIZED_RELOAD.value] = QUANTIZED_RELOAD_CUDA_NOTE
    if lora is not False:
        supported.add(Capability.LORA)
    if memory_release is False:
        notes[Capability.MEMORY_RELEASE.value] = MEMORY_RELEASE_OFF_NOTE
    else:
        supported.add(Capability.MEMORY_RELEASE)
    notes[Capability.MEMORY_CUDA_GRAPH.value] = CUDA_GRAPH_NOTE
    return Capabilities(BACKEND, engine_version, "cuda", frozenset(supported), notes)


def describe() -> Capabilities:
    """Capabilities of this machine's SGLang, without importing SGLang."""
    version = installed_version()
    return capabilities(installed_platform(), f"sglang {version}" if version else "not installed")


AMX_NOTE = (
    "sgl-kernel's CPU ops are installed: SGLang repacks linear weights for AMX after loading, so "
    "model.named_parameters() is not what the kernels read"
)


def amx_repacks() -> bool:
    """True when SGLang's CPU path repacks weights (a real CPU sgl-kernel with AMX ops)."""
    try:
        from sglang.srt.utils.common import cpu_has_amx_support

        return bool(cpu_has_amx_support())
    except Exception:
        return False
