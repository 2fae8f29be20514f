"""Fast in-place weight loading: one batched copy into the parameters instead of ``load_weights``.

Runs in the worker process (used by :class:`rlinfer_vllm.worker.RLInferWorkerExtension` in its
in-place mode only: CUDA, unquantized, no MLA, KV cache in the model's dtype).

vLLM's ``load_weights`` walks the module tree in Python for every tensor and calls the parameter's
``weight_loader``, which, for the architectures in :data:`VERIFIED_ARCHITECTURES` on CUDA without
quantization, tensor or pipeline parallelism and LoRA, does nothing but copy the tensor into a
slice of a parameter (checked against vLLM 0.26's source):

- ``q_proj``/``k_proj``/``v_proj`` into their rows of ``qkv_proj``, ``gate_proj``/``up_proj``
  into ``gate_up_proj`` (the layers' ``output_sizes``; ``QKVParallelLinear`` and
  ``MergedColumnParallelLinear.weight_loader`` narrow and ``copy_``);
- the embedding and output head into their first ``org_vocab_size`` rows (the padding rows were
  zeroed at start and nothing else writes them);
- everything else (norms, ``o_proj``, ``down_proj``, biases) whole (``default_weight_loader``);
- ``UnquantizedLinearMethod``/``UnquantizedEmbeddingMethod.process_weights_after_loading`` do
  nothing on CUDA (they repack on CPU only), so nothing has to run after the copies.

:func:`parameter_views` finds those slices once (via :func:`rlinfer_vllm.worker.served.served_tensors`,
which maps checkpoint names onto the tensors the engine serves) and keeps a name only where its
slice is a contiguous view into a parameter's storage with the checkpoint's dtype and shape, and
shares no byte with another name's slice. A tied head is one parameter (Qwen2 and Llama make
``lm_head`` the embedding's module or tensor), so writing ``model.embed_tokens.weight`` updates the
head. ``lm_head.*`` tensors of a tied model, which these architectures' ``load_weights`` skips
(``skip_prefixes``), are skipped here too (:func:`skipped_names`). A Llama-style tie (two modules,
one tensor) that a checkpoint lists under both names would otherwise be two names on the same
bytes: :func:`drop_overlaps` leaves such names out. An update is loaded fast only when *every*
tensor has a slice on its device in its dtype (:func:`fast_loader`, over the engine-agnostic
:class:`rlinfer_core.transfer.fast_load.FastLoader`); otherwise the caller uses ``load_weights``
as before.

``RLINFER_VLLM_FAST_LOAD=0`` in the engine's environment turns it off (A/B comparisons).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rlinfer_core.transfer.fast_load import Specs, drop_overlaps, parameter_storages

if TYPE_CHECKING:
    import torch

    from rlinfer_core.transfer.fast_load import FastLoader

#: switch: "0", "false", "no" or "off" turn the fast path off
ENV = "RLINFER_VLLM_FAST_LOAD"

#: model classes whose ``load_weights`` only copies into parameter slices on CUDA (unquantized)
VERIFIED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def enabled_by_env() -> bool:
    """Whether :data:`ENV` leaves the fast path on (the default)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def ineligible_reason(vllm_config: Any, model: Any) -> str | None:
    """Why this engine's updates can never be loaded fast (None: they can, given a plan).

    The caller has already established that ``load_weights`` alone puts an update in place
    (``RLInferWorkerExtension.rlinfer_loads_in_place``); these are the further conditions under
    which that ``load_weights`` is only copies into slices of the parameters.
    """
    if not enabled_by_env():
        return f"{ENV} turns it off"
    if str(vllm_config.device_config.device_type) != "cuda":
        return f"device {vllm_config.device_config.device_type} (kernels repack their weights)"
    if vllm_config.model_config.quantization is not None:
        return f"quantized ({vllm_config.model_config.quantization})"
    parallel = vllm_config.parallel_config
    if int(parallel.tensor_parallel_size) != 1 or int(parallel.pipeline_parallel_size) != 1:
        return "tensor or pipeline parallelism (each rank loads a shard)"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA (layers are wrapped)"
    name = type(model).__name__
    if name not in VERIFIED_ARCHITECTURES:
        return f"{name}: load_weights not verified to be plain copies"
    return None


def skipped_names(model: Any, names: Iterable[str]) -> frozenset[str]:
    """The names that ``load_weights`` of the verified architectures ignores: ``lm_head.*`` when
    the model ties its head to the embedding (``skip_prefixes=["lm_head."]``)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return frozenset()
    return frozenset(n for n in names if n.startswith("lm_head."))


def parameter_views(model: Any, specs: Specs, served_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the slice of a parameter that ``load_weights`` writes it to, for every
    name that has one with the checkpoint's dtype and shape (see the module docstring); names in
    :func:`skipped_names` have none."""
    from rlinfer_vllm.worker.served import served_tensors

    storages = parameter_storages(model)
    skipped = skipped_names(model, specs)
    shapes = {name: shape for name, (_, shape) in specs.items() if name not in skipped}
    served = served_tensors(model, shapes, served_dtype)
    views: dict[str, torch.Tensor] = {}
    for name, tensor in served.items():
        dtype, shape = specs[name]
        if tensor.numel() == 0 or tensor.untyped_storage().data_ptr() not in storages:
            continue  # a copy (a CPU kernel's weight read back) or a buffer, not a parameter
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape) or not tensor.is_contiguous():
            continue
        views[name] = tensor
    return drop_overlaps(views)


def fast_loader(get_model: Any, specs: Specs, served_dtype: torch.dtype) -> FastLoader:
    """The core's batched loader (:class:`rlinfer_core.transfer.fast_load.FastLoader`) over
    :func:`parameter_views` of the model ``get_model`` returns."""
    from rlinfer_core.transfer.fast_load import FastLoader, SlicePlan

    def plan(model: Any) -> SlicePlan:
        return SlicePlan(parameter_views(model, specs, served_dtype), skipped_names(model, specs))

    return FastLoader(get_model, plan)
