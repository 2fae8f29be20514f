"""Mixture-of-experts layers inside vLLM's worker: the kernel's weight layout after a reload, and
the experts read back under their Hugging Face names.

Runs in the worker process (called by :class:`rlinfer_vllm.worker.RLInferWorkerExtension` and
:mod:`rlinfer_vllm.worker.served`).

vLLM fuses a layer's experts into one ``RoutedExperts`` module: ``w13_weight`` ``[E, 2I, H]``
(every expert's gate rows, then its up rows) and ``w2_weight`` ``[E, H, I]``. The checkpoint
names them ``<prefix>.experts.<e>.<gate>.weight`` with the module's own checkpoint names
(``gate_proj``/``up_proj``/``down_proj``; Mixtral's ``w1``/``w3``/``w2``).

On CPU the expert kernel repacks both tensors into its grouped-GEMM layout after loading (and
pads ``I`` to its alignment). vLLM's layer-wise reload re-runs the layer's own processing but
skips the kernel's repacking on every reload after the first (it treats a reload as "kernel
already set up"), so the kernel went on multiplying by unpacked weights: the served policy after
any update was neither the old nor the new one. :func:`redo_expert_packing` repacks them.

Reading back: the repacking moves elements without changing them, so the permutation is found by
packing tensors of indices (in the weight dtype, one digit of the index at a time so every value
is exact) and inverted. The unpacked result is checked by packing it again: it must give the
served tensor bit for bit, or the layer is left out of the readback (reported *missing*, never
silently equal).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: the suffix vLLM gives the fused module under the checkpoint's ``experts`` prefix
ROUTED_SUFFIX = ".routed_experts"
#: unquantized expert kernels that compute with ``w13_weight``/``w2_weight`` exactly as loaded
IDENTITY_LAYOUT_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


def expert_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """(module path, module) of every fused-experts module of ``model``."""
    for path, module in model.named_modules():
        params = getattr(module, "_parameters", {})
        if "w13_weight" in params and "w2_weight" in params and hasattr(module, "moe_config"):
            yield path, module


def _fused_experts(layer: Any) -> Any:
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def _cpu_isa(layer: Any) -> str | None:
    """The CPU expert kernel's instruction set where it repacks the weights, else None."""
    fused = _fused_experts(layer)
    isa = getattr(fused, "isa", None)
    if not isinstance(isa, str) or getattr(fused, "_use_zentorch", False):
        return None
    if type(getattr(layer.quant_method, "unquantized_backend", None)).__name__ != "UnquantizedMoeBackend":
        return None
    return isa if layer.quant_method.unquantized_backend.name == "CPU" else None


def in_place_loadable(model: Any) -> bool:
    """Whether every expert layer computes with its weights as loaded (so that copying an
    update into them is the whole update)."""
    for _, layer in expert_layers(model):
        backend = getattr(getattr(layer, "quant_method", None), "unquantized_backend", None)
        if getattr(backend, "name", None) not in IDENTITY_LAYOUT_BACKENDS:
            return False
    return True


def redo_expert_packing(model: Any) -> int:
    """Repack every CPU expert layer's weights for its kernel after a reload; how many."""
    done = 0
    for _, layer in expert_layers(model):
        if _cpu_isa(layer) is not None:
            _fused_experts(layer).process_weights_after_loading(layer)
            done += 1
    return done


def _intermediate(layer: Any) -> int:
    return int(layer.moe_config.intermediate_size_per_partition)


def _exact_base(dtype: torch.dtype) -> int:
    """The largest ``b`` such that every integer in ``[0, b)`` is exact in ``dtype``."""
    import torch

    mantissa_bits = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype]
    return 1 << (mantissa_bits + 1)


def _pack(tensor: torch.Tensor, isa: str) -> torch.Tensor:
    from vllm._custom_ops import cpu_prepack_moe_weight

    packed: torch.Tensor = cpu_prepack_moe_weight(tensor.contiguous(), isa)
    return packed


@functools.cache
def _packing_sources(shape: tuple[int, ...], dtype: torch.dtype, isa: str) -> torch.Tensor | None:
    """Where each element of one packed expert ``shape`` comes from (flat indices), or None when
    the packing is not a permutation; found once per shape, dtype and instruction set."""
    import torch

    one = (1, *shape)
    count = int(torch.Size(shape).numel())
    base = _exact_base(dtype)
    index = torch.arange(count, dtype=torch.int64)
    source = torch.zeros(count, dtype=torch.int64)
    scale = 1
    while scale < count:
        digit = ((index // scale) % base).to(dtype).reshape(one)
        source += _pack(digit, isa).reshape(-1).to(torch.int64) * scale
        scale *= base
    return source if torch.equal(torch.sort(source).values, index) else None


def _unpack(packed: torch.Tensor, isa: str) -> torch.Tensor | None:
    """The tensor that packs to ``packed`` (see the module docstring), or None."""
    import torch

    source = _packing_sources(tuple(packed.shape[1:]), packed.dtype, isa)
    if source is None:
        return None
    flat = packed.reshape(packed.shape[0], source.numel())
    out = torch.empty_like(flat)
    out[:, source] = flat
    unpacked = out.reshape(packed.shape)
    return unpacked if torch.equal(_pack(unpacked, isa), packed) else None


def served_experts(model: Any) -> dict[str, torch.Tensor]:
    """HF name -> the expert weight the kernel computes with, for every expert of every layer."""
    out: dict[str, torch.Tensor] = {}
    for path, layer in expert_layers(model):
        w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
        isa = _cpu_isa(layer)
        if isa is not None:
            unpacked = (_unpack(w13, isa), _unpack(w2, isa))
            if unpacked[0] is None or unpacked[1] is None:
                continue
            w13, w2 = unpacked
        size, padded = _intermediate(layer), int(w13.shape[1]) // 2
        prefix = path.removesuffix(ROUTED_SUFFIX)
        gate, up, down = layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name
        for expert in range(int(w13.shape[0])):
            out[f"{prefix}.{expert}.{gate}.weight"] = w13[expert, :size]
            out[f"{prefix}.{expert}.{up}.weight"] = w13[expert, padded : padded + size]
            out[f"{prefix}.{expert}.{down}.weight"] = w2[expert, :, :size]
    return out
