"""Fast FP8 refit, engine-agnostic part: BF16 updates quantized straight into an online-FP8 engine's
live codes, instead of the engine's reload or ``load_weights`` + re-quantization.

An engine started with online FP8 quantization (``quantization="fp8"`` on a BF16 checkpoint) keeps,
per linear layer, E4M3 codes of the *merged* BF16 ``[out, in]`` weight (a fused layer's parts, q/k/v
or gate/up, stacked in row order) and a scale. Where a backend has verified which op and arguments
its engine quantizes with, an update is loaded here: per FP8 layer, the sent parts are copied into
their rows of one BF16 scratch (:func:`merged_input`), and the engine's own op, passed in as
``quantize`` (:data:`Quantize`), writes the codes and the scale into the live tensors; every other
tensor (norms, embeddings, head, biases) is copied into its parameter slice with one
``torch._foreach_copy_``, as :mod:`rlinfer_core.transfer.fast_load` does.

All or nothing: which tensor goes where is decided (:func:`route`) before anything is written, and
an update qualifies only when every FP8 layer it touches is given *whole* (a partial update of a
fused layer needs the unsent parts, which only the engine's own path can merge) and every other
tensor has a slice of its dtype and shape on its device. Otherwise nothing is written and the
caller takes its engine's usual path, the reason logged once.

The engine-specific halves (which layers, their live tensors, the op): ``rlinfer_vllm.worker.fp8_load``
and ``rlinfer_sglang.scheduler.fp8_load``. Plain torch; imports no engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from rlinfer_core.transfer.fast_load import Specs


@attrs.frozen(eq=False)
class Fp8Layer:
    """One FP8 linear layer: the checkpoint names of its parts in row order, their rows, the BF16
    dtype its merged input has, and the live tensors to write (``codes``: the contiguous
    ``[out, in]`` E4M3 the layer's weight is or views; ``scale``: its weight scale)."""

    module: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]
    cols: int
    dtype: Any
    codes: Any
    scale: Any


def fp8_layer(
    module: str,
    part_leaves: Sequence[str],
    rows: Sequence[int],
    cols: int,
    codes: Any,
    scale: Any,
    dtype: Any,
    specs: Specs | None = None,
) -> Fp8Layer:
    """The :class:`Fp8Layer` of module ``module`` whose rows hold the parts named ``part_leaves``
    (leaf names next to it, in row order; ``[leaf]`` for an unfused layer) with ``rows`` rows each.
    ValueError when the rows do not split the codes into those parts, or (given ``specs``) the
    checkpoint has no such part of shape ``(rows, cols)``. ``dtype``: the merged input's (None:
    the first part's in ``specs``)."""
    parent, _, _ = module.rpartition(".")
    prefix = f"{parent}." if parent else ""
    parts = tuple(f"{prefix}{leaf}.weight" for leaf in part_leaves)
    heights = tuple(int(r) for r in rows)
    if len(heights) != len(parts) or (sum(heights), int(cols)) != tuple(codes.shape):
        raise ValueError(f"{module}: logical_widths {heights} do not split it into {parts}")
    for part, height in zip(parts, heights, strict=True):
        if specs is not None and (part not in specs or tuple(specs[part][1]) != (height, cols)):
            raise ValueError(f"{module}: checkpoint has no {part} of shape {(height, cols)}")
    if dtype is None:
        if specs is None:
            raise ValueError(f"{module}: no dtype")
        dtype = specs[parts[0]][0]
    return Fp8Layer(module, parts, heights, int(cols), dtype, codes, scale)


def codes_problem(module: Any) -> str | None:
    """Why a linear layer's live ``weight`` is not its FP8 codes stored transposed (E4M3
    ``[in, out]``, the transpose of a contiguous ``[out, in]``, unpadded), as both engines keep
    them after online quantization (None: it is)."""
    import torch

    rows, cols = int(module.output_size_per_partition), int(module.input_size_per_partition)
    weight = module.weight
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (cols, rows) or not weight.t().is_contiguous():
        layout = f"{weight.dtype} {tuple(weight.shape)} stride {weight.stride()}"
        return f"weight {layout}, not the transposed E4M3 codes of [{rows}, {cols}] (padded?)"
    return None


def linear_layers(
    model: Any,
    accept: Callable[[Any], bool],
    problem: Callable[[Any], str | None],
    fused: Mapping[str, Sequence[str]],
    specs: Specs | None = None,
) -> list[Fp8Layer]:
    """Every module of ``model`` that ``accept`` takes, as an :class:`Fp8Layer` (its FP8 codes
    stored transposed, ``weight.t()`` the ``[out, in]`` rows; ``logical_widths`` rows per part);
    ``fused``: a fused module's leaf name -> its parts' leaves in row order (an unfused layer is its
    own part). ValueError naming the module when it has a ``problem`` (see :func:`fp8_layer`)."""
    layers = []
    for name, module in model.named_modules():
        if not accept(module):
            continue
        why = problem(module)
        if why is not None:
            raise ValueError(f"{name}: {why}")
        leaf = name.rpartition(".")[2]
        rows = getattr(module, "logical_widths", [module.output_size_per_partition])
        cols, dtype = int(module.input_size_per_partition), getattr(module, "orig_dtype", None)
        parts = fused.get(leaf, (leaf,))
        layers.append(fp8_layer(name, parts, rows, cols, module.weight.t(), module.weight_scale, dtype, specs))
    return layers


@attrs.frozen(eq=False)
class Fp8Plan:
    """Where each checkpoint name goes: an FP8 layer's part (``by_part``), a parameter slice
    (``views``, unquantized tensors), or nowhere (``skipped``, e.g. a tied model's ``lm_head``);
    ``zeroed``: name -> rows the engine zero-fills whenever it writes that name (as
    :class:`rlinfer_core.transfer.fast_load.SlicePlan`)."""

    layers: tuple[Fp8Layer, ...]
    by_part: Mapping[str, Fp8Layer]
    views: Mapping[str, Any]
    skipped: frozenset[str]
    zeroed: Mapping[str, Any] = attrs.field(factory=dict)


def make_plan(
    layers: Sequence[Fp8Layer],
    views: Mapping[str, Any],
    skipped: frozenset[str],
    zeroed: Mapping[str, Any] | None = None,
) -> Fp8Plan:
    """The plan of ``layers`` and the plain ``views`` (an FP8 layer's part never gets a view)."""
    by_part = {part: layer for layer in layers for part in layer.parts}
    plain = {name: view for name, view in views.items() if name not in by_part}
    pads = {name: pad for name, pad in (zeroed or {}).items() if name in plain}
    return Fp8Plan(tuple(layers), by_part, plain, skipped, pads)


#: (plain copies as (destination, source), FP8 layers with their parts' tensors in row order)
Routed = tuple[list[tuple[Any, Any]], list[tuple[Fp8Layer, list[Any]]]]


def route(plan: Fp8Plan, tensors: Sequence[tuple[str, torch.Tensor]]) -> Routed | str:
    """Where each of an update's tensors goes, or why the update does not qualify (then nothing
    may be written: the caller takes its engine's path)."""
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
                if any(tuple(t.shape) != (h, layer.cols) for t, h in zip(parts, layer.rows, strict=True)):
                    return f"{layer.module}: parts of shapes {[tuple(t.shape) for t in parts]}"
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
    """The BF16 ``[out, in]`` the engine's loaders would build for ``layer``: the parts' rows in
    order, in the layer's dtype; a lone contiguous part of that dtype as it is, else copied into
    the front of ``scratch`` (flat, the layer's dtype, at least ``out * in`` long)."""
    import torch

    if len(parts) == 1 and parts[0].dtype == layer.dtype and parts[0].is_contiguous():
        return parts[0]
    merged = scratch[: sum(layer.rows) * layer.cols].view(sum(layer.rows), layer.cols)
    torch._foreach_copy_(list(torch.split(merged, list(layer.rows))), list(parts), non_blocking=True)
    return merged


#: the engine's quantization of a merged BF16 weight, written into the layer's ``codes`` and ``scale``
Quantize = Callable[[Fp8Layer, Any], None]


class Fp8FastLoader:
    """The cached :class:`Fp8Plan` of one engine's model and the fast FP8 load with it.

    ``build`` (engine-specific) makes the plan of the model ``get_model`` returns, raising
    ValueError for a layout it does not know (then every update takes the engine's path);
    ``quantize`` is the engine's op. The plan is rebuilt when the model or any parameter's memory
    changes (:class:`rlinfer_core.transfer.fast_load.PerModel`). ``engine`` and ``fallback`` name
    the engine and its own path in the log and errors.
    """

    def __init__(
        self,
        get_model: Callable[[], Any],
        build: Callable[[Any], Fp8Plan],
        quantize: Quantize,
        *,
        engine: str,
        fallback: str,
        logger: logging.Logger,
    ) -> None:
        from rlinfer_core.transfer.fast_load import PerModel

        self._quantize = quantize
        self._build = build
        self._engine, self._fallback, self._log = engine, fallback, logger
        self._plan = PerModel(get_model, self._plan_or_none)
        self._scratch: torch.Tensor | None = None
        self._logged: set[str] = set()

    def _note(self, reason: str) -> None:
        if reason not in self._logged:  # once per reason, not per update
            self._logged.add(reason)
            self._log.info("fast FP8 load not used: %s (%s instead)", reason, self._fallback)

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
            return self._build(model)
        except Exception as exc:  # planning writes nothing: whatever it trips on, the engine's path loads
            self._note(f"no plan: {type(exc).__name__}: {exc}")
            return None

    def plan(self) -> Fp8Plan | None:
        """The current plan, rebuilt if the model's parameters changed; None where none can be made."""
        return self._plan.get()

    def _writing(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Called once an update qualified, before its first write (an engine's bookkeeping)."""

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Load ``tensors`` (names, shapes and dtypes already checked against the engine's specs)
        and return True, or write nothing and return False when the update does not qualify.
        Synchronizes the stream where a tensor is on CUDA (the sender frees its buffers next)."""
        import torch

        from rlinfer_core.errors import WeightUpdateError

        plan = self.plan()
        routed = route(plan, tensors) if plan is not None else "no plan"
        if plan is None or isinstance(routed, str):
            self._note(str(routed))
            return False
        copies, layers = routed
        try:
            with torch.no_grad():
                self._writing(tensors)
                if copies:
                    torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies], non_blocking=True)
                pads = [plan.zeroed[name] for name, _ in tensors if name in plan.zeroed]
                if pads:
                    torch._foreach_zero_(pads)
                for layer, parts in layers:
                    self._quantize(layer, merged_input(layer, parts, self._scratch_for(plan)))
            if any(t.is_cuda for _, t in tensors):
                torch.cuda.current_stream().synchronize()
        except Exception as exc:
            raise WeightUpdateError(
                f"{self._engine} failed during a fast FP8 load; the engine may hold a partial update: send a full one",
                (f"{type(exc).__name__}: {exc}",),
            ) from exc
        return True

    def _scratch_for(self, plan: Fp8Plan) -> torch.Tensor:
        """One flat buffer as large as the largest FP8 layer, kept while the plan holds."""
        import torch

        if self._scratch is None:
            largest = max(plan.layers, key=lambda layer: sum(layer.rows) * layer.cols)
            numel = sum(largest.rows) * largest.cols
            self._scratch = torch.empty(numel, dtype=largest.dtype, device=largest.codes.device)
        return self._scratch
