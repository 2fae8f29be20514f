"""What an online-quantized vLLM engine serves, against the BF16 tensors it was sent
(capability ``weights.quantized_reload``; runs in the worker, called by
:meth:`rlinfer_vllm.worker.RLInferWorkerExtension.rlinfer_quantized_check`).

vLLM's online FP8 (``quantization="fp8"`` on a BF16 checkpoint) quantizes each linear layer's
weight when it is loaded (``process_weights_after_loading``; an update goes through vLLM's
layer-wise reload, which re-runs it). The served weight is read back *through the layer's kernel*
(``quant_method.apply`` on an identity matrix, whose rows FP8 activation quantization keeps exact),
so the check does not depend on how the kernel lays out its codes and scales. Each linear weight
must lie within FP8 E4M3's rounding of the sent tensor (:func:`rlinfer_core.quantized.match_quantized`,
with the layer's ``weight_scale``); every other tensor (embeddings, norms, an unquantized output
head) must be served bit for bit. The sent tensors are the worker's host copy of the last update
(the reload mode's shadow), so no tensor travels for the check; where the fast FP8 path loaded the
last update (:mod:`rlinfer_vllm.worker.fp8_load`, which keeps no shadow) only the first rows of each
tensor were recorded, and those rows are compared (counted as ``sampled``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: identity rows fed through a kernel at once
PROBE_ROWS = 1024


def is_quantized_linear(module: Any) -> bool:
    """Whether the module is a linear layer whose weight the engine quantized (it has a scale)."""
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase) and getattr(module, "weight_scale", None) is not None


def kernel_weight(module: Any, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``W`` [rows, cols] as the layer's kernel computes with it: ``apply(I) = I @ W^T``."""
    import torch

    scale = module.weight_scale
    parts = []
    with torch.no_grad():
        for start in range(0, cols, PROBE_ROWS):
            stop = min(start + PROBE_ROWS, cols)
            eye = torch.zeros(stop - start, cols, dtype=dtype, device=scale.device)
            eye[:, start:stop] = torch.eye(stop - start, dtype=dtype, device=scale.device)
            parts.append(module.quant_method.apply(module, eye)[:, :rows].float())
    return torch.cat(parts, dim=0).t().contiguous()


def quantized_check(
    model: Any, shadow: Mapping[str, torch.Tensor], dtype: torch.dtype, shapes: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Compare what ``model`` serves with ``shadow`` (HF name -> the sent tensor, or its first rows
    where ``shapes`` (HF name -> (dtype, shape), the checkpoint's specs) gives more).

    Returns ``quantized`` / ``exact``: how many names were checked each way, ``sampled``: how many
    of those on their first rows only, ``mismatched``: the names outside their bound (or not
    bit-equal), ``unchecked``: names that map onto nothing readable, ``worst_ratio`` /
    ``worst_name`` / ``max_abs_error`` over the quantized ones.
    """
    import torch

    from rlinfer_core.quantized import match_quantized, scale_grid
    from rlinfer_vllm.worker.served import fused_parts, served_tensors

    modules = dict(model.named_modules())
    fused = fused_parts(model)
    read: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module name -> (weight, scale grid)
    report: dict[str, Any] = {"quantized": 0, "exact": 0, "sampled": 0, "mismatched": [], "unchecked": []}
    full = {name: tuple((shapes or {}).get(name, (None, sent.shape))[1]) for name, sent in shadow.items()}
    worst = (0.0, "", 0.0)
    plain: dict[str, tuple[int, ...]] = {}
    for name, sent in shadow.items():
        path, _, attr = name.rpartition(".")
        module_name, part = path, None
        if path not in modules:
            parent, _, leaf = path.rpartition(".")
            if leaf in fused:
                module_name = f"{parent}.{fused[leaf][0]}" if parent else fused[leaf][0]
                part = fused[leaf][1]
        module = modules.get(module_name)
        if module is None or attr != "weight" or not is_quantized_linear(module):
            plain[name] = full[name]
            continue
        rows, cols = int(module.output_size_per_partition), int(module.input_size_per_partition)
        if module_name not in read:
            read[module_name] = (kernel_weight(module, rows, cols, dtype), scale_grid(module.weight_scale, rows, cols))
        weight, scale = read[module_name]
        if part is not None:
            sizes = [int(s) for s in module.output_sizes]
            start = sum(sizes[:part])
            weight = weight[start : start + sizes[part]]
            scale = scale[start : start + sizes[part]] if scale.shape[0] == rows else scale
        if tuple(sent.shape) != full[name]:  # a record of the first rows
            report["sampled"] += 1
            weight = weight[: sent.shape[0]] if tuple(weight.shape) == full[name] else weight
            scale = scale[: sent.shape[0]] if scale.shape[0] == full[name][0] else scale
        if tuple(weight.shape) != tuple(sent.shape):
            report["unchecked"].append(name)
            continue
        match = match_quantized(sent.to(weight.device), weight, scale)
        report["quantized"] += 1
        if not match.ok:
            report["mismatched"].append(name)
        if match.ratio >= worst[0]:
            worst = (match.ratio, name, max(worst[2], match.max_abs_error))
        else:
            worst = (worst[0], worst[1], max(worst[2], match.max_abs_error))
    served = served_tensors(model, plain, dtype)
    for name in plain:
        tensor = served.get(name)
        if tensor is None:
            report["unchecked"].append(name)
            continue
        report["exact"] += 1
        sent = shadow[name]
        if tuple(sent.shape) != full[name]:  # a record of the first rows
            report["sampled"] += 1
            tensor = tensor[: sent.shape[0]]
        if not torch.equal(tensor.to(device="cpu", dtype=sent.dtype), sent.to("cpu")):
            report["mismatched"].append(name)
    report.update(worst_ratio=worst[0], worst_name=worst[1], max_abs_error=worst[2])
    return report
