"""What vLLM's kernels really serve, read back inside the worker and named as in the checkpoint.

Runs in the worker process (called by :class:`rlinfer_vllm.worker.RLInferWorkerExtension`).

On CUDA a linear layer multiplies by its ``weight`` parameter, so that parameter is what is served.
On CPU vLLM repacks every linear layer's weight for oneDNN / the sgl-kernel GEMM when weights are
processed after loading (``dispatch_cpu_unquantized_gemm``): the layer's ``weight`` is then empty
(linear layers) or a stale-able original (the output head, which keeps the embedding's tensor), and
the packed copy cannot be read as a tensor. There the weight is read back *through the kernel*: the
layer's own ``quant_method.apply`` on an identity matrix returns ``W^T`` exactly (every output is
one weight times 1.0 plus zeros, in the layer's dtype). A tied output head that vLLM failed to
repack after an update is therefore reported with the values it really multiplies by.

Experts fused into one tensor per layer are read back by :mod:`rlinfer_vllm.worker.experts`. Fused
parameters are sliced back by the layer's ``output_sizes`` (``qkv_proj`` into
``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj`` into ``gate_proj``/``up_proj``) following the
model's ``packed_modules_mapping``; vocabulary padding is cut to the checkpoint's shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: rows of the identity fed through a repacked CPU GEMM at once
PROBE_ROWS = 1024


def tied_modules(model: Any) -> list[Any]:
    """Modules with an unquantized kernel whose ``weight`` is the same tensor as another module's
    (a tied output head and its embedding). vLLM's layer-wise reload loads the tensor through one
    of them only, so the other one's kernel processing (CPU repacking) must be redone."""
    owners: dict[int, list[Any]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    out: list[Any] = []
    for group in owners.values():
        if len(group) > 1:
            out.extend(m for m in group if type(getattr(m, "quant_method", None)).__name__.startswith("Unquantized"))
    return out


def reprocess(modules: list[Any]) -> None:
    """Re-run the kernel processing (CPU repacking) of ``modules`` on their current weights."""
    for module in modules:
        module.quant_method.process_weights_after_loading(module)


def _gemm_layer(module: Any) -> bool:
    """Whether the module's weight is consumed by a GEMM (linear layers, the output head) rather
    than read directly (embedding lookups, norms)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, LinearBase | ParallelLMHead)


def _probe(module: Any, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``W`` [rows, cols] as the layer's CPU kernel computes with it: ``apply(I) = I @ W^T``."""
    import torch

    parts = []
    with torch.no_grad():
        for start in range(0, cols, PROBE_ROWS):
            stop = min(start + PROBE_ROWS, cols)
            eye = torch.zeros(stop - start, cols, dtype=dtype)
            eye[:, start:stop] = torch.eye(stop - start, dtype=dtype)
            out = module.quant_method.apply(module, eye)
            parts.append(out[:, :rows].to(dtype))
    return torch.cat(parts, dim=0).t().contiguous()


def _served_weight(module: Any, dtype: torch.dtype) -> torch.Tensor:
    """The weight a module computes with (see the module docstring)."""
    if hasattr(module, "cpu_linear") and _gemm_layer(module):
        if hasattr(module, "output_size_per_partition"):  # LinearBase
            rows, cols = int(module.output_size_per_partition), int(module.input_size_per_partition)
        elif hasattr(module, "output_size"):  # a linear layer that is never sharded (MoE routers)
            rows, cols = int(module.output_size), int(module.input_size)
        else:  # ParallelLMHead
            rows, cols = int(module.num_embeddings_per_partition), int(module.embedding_dim)
        return _probe(module, rows, cols, dtype)
    weight: torch.Tensor = module.weight.detach()
    return weight


def fused_parts(model: Any) -> dict[str, tuple[str, int]]:
    """HF module name (last component) -> (fused vLLM name, index of its part)."""
    mapping: dict[str, list[str]] = {}
    # a vision-language model keeps the mapping on its nested language model; the outermost wins
    for module in reversed(list(model.modules())):
        mapping.update(getattr(module, "packed_modules_mapping", None) or {})
    return {part: (fused, i) for fused, parts in mapping.items() for i, part in enumerate(parts)}


def _module_of(modules: Mapping[str, Any], fused: Mapping[str, tuple[str, int]], path: str) -> tuple[Any, int | None]:
    """The module at ``path`` (a checkpoint module name), or the fused module holding it and its
    part index; (None, None) when the model has neither."""
    path = path.removesuffix(".")
    module = modules.get(path)
    if module is not None:
        return module, None
    parent, _, leaf = path.rpartition(".")
    if leaf in fused:
        fused_name, index = fused[leaf]
        module = modules.get(f"{parent}.{fused_name}" if parent else fused_name)
        if module is not None:
            return module, index
    return None, None


def _vllm_name(model: Any, name: str) -> str | None:
    """``name`` mapped by the model's ``hf_to_vllm_mapper`` (checkpoint -> vLLM prefixes, e.g.
    Qwen2-VL's ``model.`` -> ``language_model.model.``); None without a mapper or a mapping."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    mapped: str | None = mapper.map_name(name)
    return mapped


def served_tensors(model: Any, names: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors the engine serves for each HF ``name`` (with its HF shape) that it can resolve.

    A name that maps onto no module of the model, or whose served tensor has another shape, is
    left out (and so reported missing by the comparison, never silently equal).
    """
    from rlinfer_vllm.worker.experts import served_experts

    modules = dict(model.named_modules())
    fused = fused_parts(model)
    experts = served_experts(model) if any(".experts." in name for name in names) else {}
    out: dict[str, torch.Tensor] = {}
    for name, shape in names.items():
        if name in experts:
            if tuple(experts[name].shape) == tuple(shape):
                out[name] = experts[name]
            continue
        path, _, attr = name.rpartition(".")
        module, part = _module_of(modules, fused, path)
        if module is None:  # a vision-language model nests the language model (its hf_to_vllm_mapper)
            module, part = _module_of(modules, fused, _vllm_name(model, path + ".") or path)
        if module is None:
            continue
        if attr == "weight":
            tensor = _served_weight(module, dtype)
        else:
            value = getattr(module, attr, None)
            if value is None:
                continue
            tensor = value.detach()
        if part is not None:
            sizes = [int(s) for s in getattr(module, "output_sizes", ())]
            if len(sizes) <= part or sum(sizes) != tensor.shape[0]:
                continue
            start = sum(sizes[:part])
            tensor = tensor[start : start + sizes[part]]
        if tuple(tensor.shape) != tuple(shape) and tensor.dim() >= 1 and tensor.shape[1:] == tuple(shape[1:]):
            tensor = tensor[: shape[0]]  # vocabulary padding
        if tuple(tensor.shape) == tuple(shape):
            out[name] = tensor
    return out
