"""BF16 updates into an SGLang engine that quantized its BF16 checkpoint online to FP8
(``quantization="fp8"``; capability ``weights.quantized_reload``). Runs in the scheduler process,
around :func:`rlinfer_sglang.scheduler.loader.load`'s ``model.load_weights``.

SGLang's ``Fp8LinearMethod.process_weights_after_loading`` replaces each linear layer's BF16
``weight`` by FP8 codes (transposed, ``[in, out]``) and a ``weight_scale`` (per output channel on
cutlass/marlin GPUs, else one per tensor), as plain Parameters without their weight loaders.
SGLang (0.5.16 .. 0.5.23) never re-quantizes afterwards: ``update_weights_from_tensor`` calls the
model's ``load_weights`` on those FP8 parameters (stacked ones fail without a loader, square ones
would take raw BF16 values as FP8 codes). So rlinfer does what the first load did, per layer:

1. a fresh BF16 weight parameter with the layer's own loader (``weight_loader_v2`` where the
   layer has one, as SGLang's ``create_weights`` chose), filled with the dequantized served weight
   (the parts of a fused layer an update leaves out keep their values);
2. ``model.load_weights`` as usual;
3. the layer's ``process_weights_after_loading`` quantizes it again, and the new codes and scales
   are copied *into the tensors served before* (captured CUDA graphs keep their addresses); the
   layer gets its old parameters back.

If loading fails, every layer gets its old parameters back untouched: the old weights serve.
Block-quantized layers, FP8-serialized checkpoints and FP8 MoE experts are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def online_fp8_layers(model: Any) -> list[Any]:
    """Linear layers whose FP8 weights SGLang quantized itself from a BF16 checkpoint."""
    from sglang.srt.layers.linear import LinearBase

    out = []
    for module in model.modules():
        name = type(getattr(module, "quant_method", None)).__name__
        if "Fp8" not in name or "KVCache" in name:  # unquantized, or the KV cache's scales
            continue
        config = getattr(module.quant_method, "quant_config", None)
        if getattr(config, "is_checkpoint_fp8_serialized", False):
            raise NotImplementedError("an FP8-serialized checkpoint: rlinfer re-quantizes online FP8 only")
        method = module.quant_method
        if not isinstance(module, LinearBase) or name != "Fp8LinearMethod" or method.block_quant or method.use_marlin:
            raise NotImplementedError(f"{name} (block, Marlin or MoE FP8) is not re-quantized by rlinfer")
        out.append(module)
    return out


def dequantized(layer: Any) -> Any:
    """The layer's served weight as ``[out, in]`` in its original dtype: codes ``[in, out]`` times
    the scale (one, or one per output channel as ``[1, out]``)."""
    rows, cols = int(layer.output_size_per_partition), int(layer.input_size_per_partition)
    scale = layer.weight_scale.float()
    if scale.numel() != 1 and tuple(scale.shape) != (1, rows):
        raise NotImplementedError(f"FP8 weight scale of shape {tuple(scale.shape)}: neither one nor [1, {rows}]")
    weight = (layer.weight.float() * scale).t()
    if tuple(weight.shape) != (rows, cols):
        raise NotImplementedError(f"FP8 weight layout {tuple(layer.weight.shape)} is not [in, out] = [{cols}, {rows}]")
    return weight.to(layer.orig_dtype).contiguous()


@contextlib.contextmanager
def requantizing(model: Any) -> Iterator[int]:
    """Around ``model.load_weights`` of BF16 tensors: gives the online-FP8 layers BF16 weights to
    load into, then quantizes them again in place (see the module docstring); yields how many."""
    from sglang.srt.layers.parameter import ModelWeightParameter

    layers = online_fp8_layers(model)
    saved: list[tuple[Any, Any, Any]] = []
    try:
        for layer in layers:
            loader = getattr(layer, "weight_loader_v2", None) or layer.weight_loader
            fresh = ModelWeightParameter(data=dequantized(layer), input_dim=1, output_dim=0, weight_loader=loader)
            saved.append((layer, layer.weight, layer.weight_scale))
            layer.weight = fresh
        yield len(layers)
    except BaseException:
        for layer, weight, scale in saved:
            layer.weight, layer.weight_scale = weight, scale
        raise
    for layer, weight, scale in saved:
        layer.quant_method.process_weights_after_loading(layer)
        new_weight, new_scale = layer.weight, layer.weight_scale
        if new_weight.shape != weight.shape or new_scale.shape != scale.shape or new_weight.dtype != weight.dtype:
            raise RuntimeError(f"re-quantized layout changed: {tuple(new_weight.shape)} vs {tuple(weight.shape)}")
        weight.data.copy_(new_weight.data)
        scale.data.copy_(new_scale.data)
        layer.weight, layer.weight_scale = weight, scale
