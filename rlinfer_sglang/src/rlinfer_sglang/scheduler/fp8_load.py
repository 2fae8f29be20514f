"""Fast FP8 refit in SGLang's scheduler: BF16 updates quantized straight into the live FP8 codes of an
engine started with ``quantization="fp8"`` on a BF16 checkpoint, instead of
:func:`~rlinfer_sglang.scheduler.requantize.requantizing` (dequantize every layer, ``load_weights``,
``process_weights_after_loading`` again). The engine-agnostic part (grouping, merge order, the
whole-layer check, the scratch, all or nothing): :mod:`rlinfer_core.transfer.fp8_fast_load`.

**What SGLang 0.5.16 does** (the GPU bundle's release; ``layers/quantization/fp8.py`` read from the
0.5.16 wheel, unchanged in 0.5.23 for CUDA): ``Fp8Config.get_quant_method`` gives every
``LinearBase`` an ``Fp8LinearMethod`` (embeddings and the head stay unquantized, attention gets
``Fp8KVCacheMethod``, MoE ``Fp8MoEMethod``). ``create_weights`` (``is_checkpoint_fp8_serialized``
False) makes ``weight`` the merged BF16 ``[out, in]`` (``logical_widths``: the fused layer's
``output_partition_sizes``, q/k/v or gate/up in order; ``orig_dtype``: BF16), no scale, no input
scale; the layers' weight loaders copy each checkpoint tensor into its rows. Then
``process_weights_after_loading``, not block-quantized, on Hopper (SM 9.0, CUDA >= 12:
``cutlass_fp8_supported()`` is True; Marlin only on SM 8.0-8.8; no aiter on CUDA):

- ``qweight, weight_scale = per_token_group_quant_fp8(layer.weight, layer.weight.shape[-1])``: one
  group per row, i.e. a float32 scale per *output channel* (``sglang_per_token_group_quant_fp8`` on
  CUDA, default ``eps=1e-10``, row-major scales ``[out, 1]``), E4M3 codes ``[out, in]`` contiguous;
- ``weight_scale = weight_scale.t().contiguous()``: ``[1, out]``;
- ``layer.weight = Parameter(qweight.t())`` (``[in, out]``, a view of the contiguous codes),
  ``layer.weight_scale = Parameter(weight_scale)``, ``layer.input_scale = None`` (activations are
  quantized dynamically per token by the cutlass kernel's ``apply_fp8_linear``).

(Without cutlass it would be ``input_to_float8``, one scale per tensor: not this path.)

**What this module reproduces:** for each ``Fp8LinearMethod`` layer, the sent parts are copied into
their rows of one BF16 scratch ``[out, in]`` (a lone contiguous BF16 part is used as sent), the same
``per_token_group_quant_fp8(merged, merged.shape[-1])`` (looked up on SGLang's ``fp8`` module, so
whatever that module calls) quantizes it, and its codes are copied into the live codes (the
contiguous ``[out, in]`` that ``layer.weight`` views) and ``scale.t()`` into the live
``weight_scale``. Same op, same arguments, same input values: the bytes a re-quantization leaves,
in the tensors served before (captured CUDA graphs keep their addresses). Unquantized tensors
(norms, embeddings, head, biases) go into the parameter slices of
:func:`rlinfer_sglang.scheduler.fast_load.parameter_views`, with its zero-filled vocabulary padding.

**When it applies** (:func:`engine_reason`, :func:`layer_problem`; anything else keeps the
re-quantization path, the reason logged once): what the BF16 fast path needs (CUDA, TP = PP = 1,
the legacy loader, Llama/Qwen2/Qwen3, no LoRA; ``RLINFER_SGLANG_FAST_LOAD=0`` turns both off) with
the quant methods of :data:`METHODS` only (so no MoE), at least one online-FP8 layer, and every such
layer not serialized, not block-quantized, without Marlin, on cutlass, with E4M3 codes ``[in, out]``
whose transpose is contiguous, a float32 ``weight_scale`` ``[1, out]`` and no input scale. An
update qualifies when every FP8 layer it touches is given *whole* (all of q/k/v, both of gate/up);
a partial update of a fused layer takes the re-quantization path, which dequantizes the unsent
parts. SGLang has no host copy of the weights to keep in step, and rlinfer has no ``quantized_check``
for SGLang, so nothing else is recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlinfer_sglang.scheduler.fast_load import PLAIN_METHODS, SchedulerPath, loaded_by

if TYPE_CHECKING:
    import torch

    from rlinfer_core.transfer.fp8_fast_load import Fp8Layer, Fp8Plan

#: the quant method of ``quantization="fp8"`` on a BF16 checkpoint (SGLang 0.5.16 .. 0.5.23)
METHOD = ("sglang.srt.layers.quantization.fp8", "Fp8LinearMethod")
#: quant methods an engine may have for this path: unquantized layers, the KV cache's scales (no
#: weights of a checkpoint), and the online FP8 linear method
METHODS = PLAIN_METHODS | {"Fp8KVCacheMethod", METHOD[1]}

log = logging.getLogger("rlinfer_sglang.scheduler")


def is_online_fp8(module: Any) -> bool:
    """Whether the module's quant method is SGLang's ``Fp8LinearMethod``."""
    method = type(getattr(module, "quant_method", None))
    return (method.__module__, method.__name__) == METHOD


def engine_reason(model: Any) -> str | None:
    """Why this engine's updates can never be quantized here (None: they can, given a plan)."""
    from rlinfer_sglang.scheduler.fast_load import engine_reason as plain_reason

    reason = plain_reason(model, METHODS)
    if reason is None and not _is_quantized(model):
        return "no online-FP8 layer"
    return reason


def layer_problem(module: Any) -> str | None:
    """Why an ``Fp8LinearMethod`` layer is not in the layout this module writes (None: it is)."""
    import torch

    from rlinfer_core.transfer.fp8_fast_load import codes_problem

    method = module.quant_method
    names = ("is_checkpoint_fp8_serialized", "block_quant", "use_marlin", "use_mxfp8", "cutlass_fp8_supported")
    serialized, block, marlin, mxfp8, cutlass = (getattr(method, name, None) for name in names)
    if serialized is not False or block is not False or marlin is not False or mxfp8 or cutlass is not True:
        flags = dict(zip(names, (serialized, block, marlin, mxfp8, cutlass), strict=True))
        return f"not online per-channel FP8 on cutlass ({flags})"
    codes = codes_problem(module)
    if codes is not None:
        return codes
    rows, scale = int(module.output_size_per_partition), getattr(module, "weight_scale", None)
    if scale is None or tuple(scale.shape) != (1, rows) or scale.dtype != torch.float32:
        return f"weight_scale is not float32 [1, {rows}] (per output channel)"
    if getattr(module, "input_scale", None) is not None:
        return "a static input scale"
    return None


def build_plan(model: Any) -> Fp8Plan:
    """The plan for ``model``; ValueError when a module or layer is not what this module knows."""
    from rlinfer_core.transfer.fp8_fast_load import linear_layers, make_plan
    from rlinfer_sglang.scheduler.fast_load import parameter_views
    from rlinfer_sglang.scheduler.loader import _FUSED

    layers = linear_layers(model, is_online_fp8, layer_problem, dict(_FUSED))
    if not layers:
        raise ValueError("no online-FP8 layer")
    plain = parameter_views(model)
    views = {n: v for n, v in plain.views.items() if not str(v.dtype).startswith("torch.float8")}
    return make_plan(layers, views, plain.skipped, plain.zeroed)


def quantize_into(layer: Fp8Layer, merged: torch.Tensor) -> None:
    """SGLang's ``process_weights_after_loading`` quantization of ``merged`` (see the module
    docstring), its codes and scales copied into the layer's live ones."""
    from sglang.srt.layers.quantization import fp8

    codes, scale = fp8.per_token_group_quant_fp8(merged, merged.shape[-1])
    layer.codes.copy_(codes, non_blocking=True)
    layer.scale.copy_(scale.t(), non_blocking=True)


def _is_quantized(model: Any) -> bool:
    return any(is_online_fp8(module) for module in model.modules())


def _path() -> SchedulerPath:
    from rlinfer_core.transfer.fp8_fast_load import Fp8FastLoader

    def loader(get_model: Any) -> Fp8FastLoader:
        fallback = "rlinfer's re-quantization after load_weights"
        return Fp8FastLoader(get_model, build_plan, quantize_into, engine="SGLang", fallback=fallback, logger=log)

    return SchedulerPath("fast FP8 loading", engine_reason, loader, worth_logging=_is_quantized)


def loaded_fast_fp8(model: Any, tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[bool, float]:
    """The fast FP8 path of this process (the reason it is off logged once, for an FP8 engine only):
    loaded or not (then nothing was written: re-quantize), and its plan time (seconds)."""
    return loaded_by("fp8", _path, model, tensors)
