"""Fast FP8 refit: online FP8 quantization of sent BF16 tensors without vLLM's layer-wise reload.

Runs in the worker process (used by :class:`rlinfer_vllm.worker.RLInferWorkerExtension` in its
reload mode, on an engine started with ``quantization="fp8"`` on a BF16 checkpoint).

**What vLLM 0.26 does** (``model_executor/layers/quantization/fp8.py`` and ``online/fp8.py``, read
from the 0.26.0 wheel): ``Fp8Config`` with ``is_checkpoint_fp8_serialized=False`` gives every
linear layer an ``Fp8PerTensorOnlineLinearMethod`` (embeddings and the output head stay
unquantized; attention gets ``Fp8KVCacheMethod``, whose processing is a no-op once the checkpoint's
KV scales were consumed at start and ``kv_cache_dtype="auto"``). The layer's ``weight`` is created
on the meta device as the merged BF16 ``[out, in]`` (``qkv_proj``: q, k, v rows in
``logical_widths`` order; ``gate_up_proj``: gate, up); the weight loaders copy each checkpoint
tensor into its rows; ``process_weights_after_loading`` then runs

- ``qweight, weight_scale = ops.scaled_fp8_quant(layer.weight, scale=None)``: one dynamic
  *per-tensor* scale (float32, shape ``[1]``) over the *merged* weight, E4M3 codes ``[out, in]``;
- ``layer.weight = qweight.t()`` (stored transposed: ``[in, out]``, a view of the contiguous
  codes), ``layer.weight_scale = weight_scale``, ``layer.input_scale = None`` (activations are
  quantized dynamically per token, no static input scale);
- the kernel's own ``process_weights_after_loading``: on Hopper (SM 9.0) the kernel is
  ``CutlassFP8ScaledMMLinearKernel`` (Marlin only below SM 8.9, FlashInfer from SM 10.0), which pads
  ``weight`` to multiples of 16 when a dimension is not one and otherwise changes nothing; the
  FlashInfer and torch ``_scaled_mm`` per-tensor kernels change nothing. No block quantization
  (block FP8 online is ``Fp8PerBlockOnlineLinearMethod``, not chosen by ``quantization="fp8"``).

An update goes through ``Worker.reload_weights`` (``model_loader/reload/layerwise.py``), which per
layer materializes a fresh BF16 ``[out, in]`` weight, loads the update into it, re-runs the above,
and copies the resulting codes and scale into the tensors the layer held before (``param.data.copy_``,
so CUDA graphs keep their addresses).

**What this module reproduces:** for each quantized layer, the sent parts are copied into their rows
of one BF16 scratch ``[out, in]`` (a single unfused tensor is used as sent when it is contiguous and
of the layer's dtype), and the same ``ops.scaled_fp8_quant(merged, scale=None)`` writes its codes
straight into the live weight's storage (``output=layer.weight.t()``, the contiguous ``[out, in]``
the layer's transposed view is of); the returned scale is copied into ``layer.weight_scale``. Same op,
same input values, same output layout: the bytes a reload would leave. Unquantized tensors (norms,
embeddings, head, biases) are copied into their parameter slices as the BF16 fast path does
(:func:`rlinfer_vllm.worker.fast_load.parameter_views`), with one ``_foreach_copy_``.

The engine-agnostic part (the grouping, the merge, the routing, the all-or-nothing load) is
:mod:`rlinfer_core.transfer.fp8_fast_load`, shared with SGLang's ``rlinfer_sglang.scheduler.fp8_load``;
this module gives it vLLM's layers, op and the shadow's bookkeeping.

**When it applies** (:func:`ineligible_reason`, :func:`layer_problem`; anything else keeps vLLM's
reload, the reason logged once): vLLM 0.26.x on CUDA, ``quantization="fp8"``, the architectures of
:data:`rlinfer_vllm.worker.fast_load.VERIFIED_ARCHITECTURES`, TP = PP = 1, no LoRA,
``kv_cache_dtype="auto"``, every module's quant method either this online FP8 method or unquantized
or the KV-cache method (so no MoE), and every FP8 layer with a kernel from :data:`KERNELS`, an
unpadded ``[in, out]`` E4M3 weight whose transpose is contiguous, a one-element float32 scale and no
input scale. An update qualifies when every FP8 layer it touches is given *whole* (all of q/k/v,
both of gate/up) and every other tensor has a parameter slice; a partial update of a fused layer
falls back to the reload, which merges it with the host shadow.

**All or nothing, and no host shadow for this path.** Names, shapes and dtypes were checked by the
worker, and which tensors go where is decided before anything is written; after that only a CUDA
fault can interrupt (reported as a possibly partial update, as in the in-place mode). Every FP8
layer it writes is given whole, so nothing unsent is needed to rebuild it: the shadow's only role
(merging partial updates of fused layers, restoring after a failed reload) does not arise. The
shadow is not updated (a device-to-host copy of the whole update costs more than the refit), so
its entries for the names loaded here are *stale* (:attr:`Fp8FastLoader.stale`): a later reload
that would need one of them (a partial fused update) is refused with a typed error before anything
is touched, and a full update (either path) makes the engine consistent again. For
``quantized_check`` the loader keeps a cheap record instead: the first :data:`RECORD_ROWS` rows of
every tensor it loaded (whole 1-D tensors), copied on the device with one ``_foreach_copy_``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlinfer_core.transfer.fp8_fast_load import Fp8FastLoader as CoreFp8FastLoader
from rlinfer_core.transfer.fp8_fast_load import Fp8Layer, Fp8Plan, Quantize, codes_problem, linear_layers, make_plan
from rlinfer_core.transfer.fp8_fast_load import merged_input as merged_input  # re-exported (tests)
from rlinfer_core.transfer.fp8_fast_load import route as route  # re-exported (tests)

if TYPE_CHECKING:
    import torch

    from rlinfer_core.transfer.fast_load import Specs

#: the vLLM release whose online FP8 this module reproduces (others keep the reload)
VLLM_SERIES = "0.26."
#: the quant method of ``quantization="fp8"`` on a BF16 checkpoint in vLLM 0.26
METHOD = ("vllm.model_executor.layers.quantization.online.fp8", "Fp8PerTensorOnlineLinearMethod")
#: kernels that read ``layer.weight`` / ``weight_scale`` as left by the method (no repacking)
KERNELS = frozenset(
    {
        "CutlassFP8ScaledMMLinearKernel",
        "FlashInferFP8ScaledMMLinearKernel",
        "PerTensorTorchFP8ScaledMMLinearKernel",
        "ChannelWiseTorchFP8ScaledMMLinearKernel",
    }
)
#: quant methods the plan tolerates on other modules (they are not touched by the reload either)
OTHER_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "Fp8KVCacheMethod"})
#: rows of each loaded tensor kept for ``quantized_check``
RECORD_ROWS = 8

log = logging.getLogger("rlinfer_vllm.worker")


def ineligible_reason(vllm_config: Any, model: Any) -> str | None:
    """Why this engine's FP8 updates can never be loaded fast (None: they can, given a plan)."""
    import vllm

    from rlinfer_vllm.worker.fast_load import ENV, VERIFIED_ARCHITECTURES, enabled_by_env

    if not enabled_by_env():
        return f"{ENV} turns it off"
    if str(vllm_config.device_config.device_type) != "cuda":
        return f"device {vllm_config.device_config.device_type}"
    if vllm_config.model_config.quantization != "fp8":
        return f"quantization {vllm_config.model_config.quantization!r}, not online 'fp8'"
    if not str(vllm.__version__).startswith(VLLM_SERIES):
        return f"vLLM {vllm.__version__}: the fast FP8 path follows vLLM {VLLM_SERIES}x"
    if getattr(vllm_config.quant_config, "is_checkpoint_fp8_serialized", True):
        return "an FP8-serialized checkpoint (not online quantization)"
    parallel = vllm_config.parallel_config
    if int(parallel.tensor_parallel_size) != 1 or int(parallel.pipeline_parallel_size) != 1:
        return "tensor or pipeline parallelism (each rank loads a shard)"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA (layers are wrapped)"
    if vllm_config.cache_config.cache_dtype != "auto":
        return f"kv_cache_dtype {vllm_config.cache_config.cache_dtype} (attention scales are processed)"
    if type(model).__name__ not in VERIFIED_ARCHITECTURES:
        return f"{type(model).__name__}: load_weights not verified"
    return None


def is_online_fp8(module: Any) -> bool:
    """Whether the module's quant method is vLLM 0.26's online per-tensor FP8 linear method."""
    method = type(getattr(module, "quant_method", None))
    return (method.__module__, method.__name__) == METHOD


def layer_problem(module: Any) -> str | None:
    """Why an online-FP8 layer's live tensors are not in the layout this module writes (None: they are)."""
    import torch

    method = module.quant_method
    kernel = type(getattr(method, "fp8_linear", None)).__name__
    marlin, block = getattr(method, "use_marlin", None), getattr(method, "block_quant", None)
    if kernel not in KERNELS or marlin is not False or block is not False:
        return f"kernel {kernel} (use_marlin={marlin}, block_quant={block})"
    codes = codes_problem(module)
    if codes is not None:
        return codes
    scale = getattr(module, "weight_scale", None)
    if scale is None or scale.numel() != 1 or scale.dtype != torch.float32:
        return "weight_scale is not one float32 (per-tensor)"
    if getattr(module, "input_scale", None) is not None or getattr(module, "weight_block_size", None) is not None:
        return "a static input scale or a block size"
    return None


def plan_layers(
    model: Any, specs: Specs, accept: Callable[[Any], bool], problem: Callable[[Any], str | None]
) -> list[Fp8Layer]:
    """Every module ``accept`` takes, as an :class:`Fp8Layer`; raises ValueError when one has a
    ``problem``, or its parts (``packed_modules_mapping`` and ``logical_widths``) do not match the
    checkpoint's names and shapes in ``specs``."""
    from rlinfer_vllm.worker.served import fused_parts

    order: dict[str, list[str]] = {}  # fused module leaf -> its parts' leaves in row order
    for part_leaf, (fused, _) in sorted(fused_parts(model).items(), key=lambda item: item[1][1]):
        order.setdefault(fused, []).append(part_leaf)
    return linear_layers(model, accept, problem, order, specs)


def build_plan(
    model: Any,
    specs: Specs,
    served_dtype: torch.dtype,
    accept: Callable[[Any], bool] = is_online_fp8,
    problem: Callable[[Any], str | None] = layer_problem,
) -> Fp8Plan:
    """The plan for ``model``; ValueError when a module or layer is not what this module knows."""
    from rlinfer_vllm.worker.fast_load import parameter_views, skipped_names

    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not accept(module) and type(method).__name__ not in OTHER_METHODS:
            raise ValueError(f"{name}: quant method {type(method).__name__}")
    layers = plan_layers(model, specs, accept, problem)
    parts = {part for layer in layers for part in layer.parts}
    views = parameter_views(model, {name: spec for name, spec in specs.items() if name not in parts}, served_dtype)
    return make_plan(layers, views, skipped_names(model, specs))


def quantize_into(layer: Fp8Layer, merged: torch.Tensor) -> None:
    """vLLM 0.26's ``process_weights_after_loading`` quantization of ``merged``, written into the
    layer's live codes and scale (see the module docstring)."""
    from vllm import _custom_ops as ops

    _, scale = ops.scaled_fp8_quant(merged, scale=None, output=layer.codes)
    layer.scale.copy_(scale.reshape(layer.scale.shape), non_blocking=True)


class Fp8FastLoader(CoreFp8FastLoader):
    """The core's fast FP8 load (:class:`rlinfer_core.transfer.fp8_fast_load.Fp8FastLoader`) with
    vLLM's plan and op, and what the reload mode's shadow no longer holds (:attr:`stale`,
    :attr:`records`; see the module docstring)."""

    def __init__(
        self,
        get_model: Callable[[], Any],
        specs: Specs,
        served_dtype: torch.dtype,
        quantize: Quantize = quantize_into,
        build: Callable[[Any, Specs, Any], Fp8Plan] = build_plan,
    ) -> None:
        super().__init__(
            get_model,
            lambda model: build(model, specs, served_dtype),
            quantize,
            engine="vLLM",
            fallback="vLLM's reload",
            logger=log,
        )
        #: names loaded here since the shadow last held them
        self.stale: set[str] = set()
        #: name -> its first :data:`RECORD_ROWS` rows as last loaded here (for ``quantized_check``)
        self.records: dict[str, torch.Tensor] = {}

    def _writing(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        # stale from here on: after a fault mid-way the shadow must not stand in for these names
        self.stale.update(name for name, _ in tensors)
        self._record(tensors)

    def _record(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Keep each tensor's first rows on its device (one batched copy)."""
        import torch

        heads = [(name, t[:RECORD_ROWS] if t.dim() > 1 else t) for name, t in tensors]
        for name, head in heads:
            kept = self.records.get(name)
            if kept is None or kept.shape != head.shape or kept.dtype != head.dtype or kept.device != head.device:
                self.records[name] = torch.empty_like(head, memory_format=torch.contiguous_format)
        torch._foreach_copy_([self.records[n] for n, _ in heads], [h for _, h in heads], non_blocking=True)

    def require_fresh(self, needed: Iterable[str]) -> None:
        """Raise before a reload that would take ``needed`` from the shadow where it is stale."""
        from rlinfer_core.errors import WeightUpdateError

        stale = sorted(set(needed) & self.stale)
        if stale:
            raise WeightUpdateError(
                "this update gives part of a fused FP8 layer, whose other inputs the worker no longer "
                "holds (earlier updates took the fast FP8 path, which keeps no host copy): send every "
                "input of each fused layer (q/k/v, gate/up) or a full update",
                tuple(f"{name}: not in this update" for name in stale[:8]),
            )

    def require_restorable(self) -> None:
        """Raise, after a reload failed inside vLLM, where the shadow lacks what was served before."""
        from rlinfer_core.errors import WeightUpdateError

        if self.stale:
            raise WeightUpdateError(
                "vLLM failed while reloading and the weights served before came through the fast FP8 "
                "path (no host copy to restore): the engine may hold a partial update: send a full one",
                tuple(sorted(self.stale)[:8]),
            )

    def refreshed(self, names: Iterable[str]) -> None:
        """The shadow holds ``names`` again (a reload committed them, or a checkpoint was read)."""
        for name in names:
            self.stale.discard(name)
            self.records.pop(name, None)

    def sent(self, shadow: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The last sent tensors for ``quantized_check``: the shadow's, with the records (first
        rows) for the names it holds stale."""
        return {name: self.records[name] if name in self.stale else tensor for name, tensor in shadow.items()}


def loader_for(worker: Any) -> Fp8FastLoader | None:
    """The fast FP8 loader for a reload-mode ``RLInferWorkerExtension``, or None where it can never
    apply (logged for a quantized engine)."""
    config, get_model = worker.vllm_config, worker.model_runner.get_model
    why_not = ineligible_reason(config, get_model())
    if why_not is not None:
        if config.model_config.quantization is not None:
            log.info("fast FP8 loading off: %s", why_not)
        return None
    return Fp8FastLoader(get_model, worker._rlinfer_specs, config.model_config.dtype)
