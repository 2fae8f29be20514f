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

import attrs

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
    rows, cols = int(module.output_size_per_partition), int(module.input_size_per_partition)
    weight, scale = module.weight, getattr(module, "weight_scale", None)
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (cols, rows) or not weight.t().is_contiguous():
        layout = f"{weight.dtype} {tuple(weight.shape)} stride {weight.stride()}"
        return f"weight {layout}, not the transposed E4M3 codes of [{rows}, {cols}] (padded?)"
    if scale is None or scale.numel() != 1 or scale.dtype != torch.float32:
        return "weight_scale is not one float32 (per-tensor)"
    if getattr(module, "input_scale", None) is not None or getattr(module, "weight_block_size", None) is not None:
        return "a static input scale or a block size"
    return None


@attrs.frozen(eq=False)
class Fp8Layer:
    """One FP8 linear layer: the checkpoint names of its parts in row order, their rows, and the
    live tensors to write (``codes``: the contiguous ``[out, in]`` the layer's ``weight`` views)."""

    module: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]
    cols: int
    dtype: Any  # the layer's BF16 dtype (the merged input's)
    codes: Any
    scale: Any


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
    layers: list[Fp8Layer] = []
    for name, module in model.named_modules():
        if not accept(module):
            continue
        why = problem(module)
        if why is not None:
            raise ValueError(f"{name}: {why}")
        parent, _, leaf = name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        parts = tuple(f"{prefix}{p}.weight" for p in order.get(leaf, [leaf]))
        rows = tuple(int(r) for r in getattr(module, "logical_widths", [module.output_size_per_partition]))
        cols = int(module.input_size_per_partition)
        if len(rows) != len(parts) or sum(rows) != int(module.output_size_per_partition):
            raise ValueError(f"{name}: logical_widths {rows} do not split it into {parts}")
        for part, height in zip(parts, rows, strict=True):
            if part not in specs or tuple(specs[part][1]) != (height, cols):
                raise ValueError(f"{name}: checkpoint has no {part} of shape {(height, cols)}")
        dtype = getattr(module, "orig_dtype", None) or specs[parts[0]][0]
        layers.append(Fp8Layer(name, parts, rows, cols, dtype, module.weight.t(), module.weight_scale))
    return layers


@attrs.frozen(eq=False)
class Fp8Plan:
    """Where each checkpoint name goes: an FP8 layer's part (``by_part``), a parameter slice
    (``views``, unquantized tensors), or nowhere (``skipped``, a tied model's ``lm_head``)."""

    layers: tuple[Fp8Layer, ...]
    by_part: Mapping[str, Fp8Layer]
    views: Mapping[str, Any]
    skipped: frozenset[str]


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
    by_part = {part: layer for layer in layers for part in layer.parts}
    plain = {name: spec for name, spec in specs.items() if name not in by_part}
    views = parameter_views(model, plain, served_dtype)
    return Fp8Plan(tuple(layers), by_part, views, skipped_names(model, specs))


Routed = tuple[list[tuple[Any, Any]], list[tuple[Fp8Layer, list[Any]]]]


def route(plan: Fp8Plan, tensors: Sequence[tuple[str, torch.Tensor]]) -> Routed | str:
    """(plain copies as (destination, source), FP8 layers with their parts' tensors in row order) for
    an update, or why it does not qualify (then nothing may be written: the caller reloads)."""
    given = dict(tensors)
    copies: list[tuple[Any, Any]] = []
    layers: dict[str, tuple[Fp8Layer, list[Any]]] = {}
    for name, tensor in tensors:
        layer = plan.by_part.get(name)
        if layer is not None:
            if layer.module not in layers:
                missing = [p for p in layer.parts if p not in given]
                if missing:
                    return f"{layer.module}: partial update (no {', '.join(missing)})"
                parts = [given[p] for p in layer.parts]
                if any(t.device != layer.codes.device or not t.is_floating_point() for t in parts):
                    return f"{layer.module}: a part is not a floating-point tensor on {layer.codes.device}"
                layers[layer.module] = (layer, parts)
            continue
        if name in plan.skipped:
            continue
        dest = plan.views.get(name)
        if dest is None:
            return f"{name}: no parameter slice to copy into"
        if dest.device != tensor.device or dest.dtype != tensor.dtype or dest.shape != tensor.shape:
            return f"{name}: {tensor.dtype} on {tensor.device}, its slice {dest.dtype} on {dest.device}"
        copies.append((dest, tensor))
    return copies, list(layers.values())


def merged_input(layer: Fp8Layer, parts: Sequence[torch.Tensor], scratch: torch.Tensor) -> torch.Tensor:
    """The BF16 ``[out, in]`` vLLM's loaders would build for ``layer``: the parts' rows in order
    (``logical_widths``), in the layer's dtype; a lone contiguous part of that dtype as it is, else
    copied into the front of ``scratch`` (flat, the layer's dtype, at least ``out * in`` long)."""
    import torch

    if len(parts) == 1 and parts[0].dtype == layer.dtype and parts[0].is_contiguous():
        return parts[0]
    merged = scratch[: sum(layer.rows) * layer.cols].view(sum(layer.rows), layer.cols)
    torch._foreach_copy_(list(torch.split(merged, list(layer.rows))), list(parts), non_blocking=True)
    return merged


def quantize_into(layer: Fp8Layer, merged: torch.Tensor) -> None:
    """vLLM 0.26's ``process_weights_after_loading`` quantization of ``merged``, written into the
    layer's live codes and scale (see the module docstring)."""
    from vllm import _custom_ops as ops

    _, scale = ops.scaled_fp8_quant(merged, scale=None, output=layer.codes)
    layer.scale.copy_(scale.reshape(layer.scale.shape), non_blocking=True)


class Fp8FastLoader:
    """The cached :class:`Fp8Plan` of one engine's model, the fast FP8 load with it, and what the
    reload mode's shadow no longer holds (:attr:`stale`, :attr:`records`; see the module docstring)."""

    def __init__(
        self,
        get_model: Callable[[], Any],
        specs: Specs,
        served_dtype: torch.dtype,
        quantize: Callable[[Fp8Layer, Any], None] = quantize_into,
        build: Callable[[Any, Specs, Any], Fp8Plan] = build_plan,
    ) -> None:
        from rlinfer_core.transfer.fast_load import PerModel

        self._quantize = quantize
        self._build = build
        self._specs = specs
        self._dtype = served_dtype
        self._plan = PerModel(get_model, self._plan_or_none)
        self._scratch: torch.Tensor | None = None
        self._logged: set[str] = set()
        #: names loaded here since the shadow last held them
        self.stale: set[str] = set()
        #: name -> its first :data:`RECORD_ROWS` rows as last loaded here (for ``quantized_check``)
        self.records: dict[str, torch.Tensor] = {}

    def _note(self, reason: str) -> None:
        if reason not in self._logged:  # once per reason, not per update
            self._logged.add(reason)
            log.info("fast FP8 load not used: %s (vLLM's reload instead)", reason)

    @property
    def plan_s(self) -> float:
        """Seconds spent building the plan at the last :meth:`load` (0.0 when cached)."""
        return self._plan.plan_s

    def invalidate(self) -> None:
        """Forget the plan (and the references it holds on the parameters)."""
        self._plan.invalidate()
        self._scratch = None

    def _plan_or_none(self, model: Any) -> Fp8Plan | None:
        self._scratch = None  # sized for the plan it was made for
        try:
            return self._build(model, self._specs, self._dtype)
        except ValueError as exc:
            self._note(f"no plan: {exc}")
            return None

    def plan(self) -> Fp8Plan | None:
        """The current plan, rebuilt if the model's parameters changed; None where none can be made."""
        return self._plan.get()

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Load ``tensors`` (names, shapes and dtypes already checked) and return True, or write
        nothing and return False when the update does not qualify. Synchronizes the stream."""
        import torch

        from rlinfer_core.errors import WeightUpdateError

        plan = self.plan()
        routed = route(plan, tensors) if plan is not None else "no plan"
        if isinstance(routed, str):
            self._note(routed)
            return False
        copies, layers = routed
        # stale from here on: after a fault mid-way the shadow must not stand in for these names
        self.stale.update(name for name, _ in tensors)
        try:
            with torch.no_grad():
                self._record(tensors)
                if copies:
                    torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies], non_blocking=True)
                for layer, parts in layers:
                    self._quantize(layer, merged_input(layer, parts, self._scratch_for(plan)))
            if any(t.is_cuda for _, t in tensors):  # the sender frees its buffers once we return
                torch.cuda.current_stream().synchronize()
        except Exception as exc:
            raise WeightUpdateError(
                "vLLM failed during a fast FP8 load; the engine may hold a partial update: send a full one",
                (f"{type(exc).__name__}: {exc}",),
            ) from exc
        return True

    def _scratch_for(self, plan: Fp8Plan | None) -> torch.Tensor:
        """One flat buffer as large as the largest FP8 layer, kept while the plan holds."""
        import torch

        if self._scratch is None:
            assert plan is not None and plan.layers
            largest = max(plan.layers, key=lambda layer: sum(layer.rows) * layer.cols)
            numel = sum(largest.rows) * largest.cols
            self._scratch = torch.empty(numel, dtype=largest.dtype, device=largest.codes.device)
        return self._scratch

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
