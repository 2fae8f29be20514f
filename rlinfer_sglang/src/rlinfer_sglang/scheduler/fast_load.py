"""Fast in-place weight loading in SGLang's scheduler: one batched copy into the parameters instead
of ``model.load_weights`` (the engine-agnostic part: :mod:`rlinfer_core.transfer.fast_load`).

Used by :func:`rlinfer_sglang.scheduler.loader.load` when :func:`ineligible_reason` finds nothing:
CUDA, tensor and pipeline parallel size 1, SGLang's legacy ``load_weights`` (not
``SGLANG_ENABLE_WEIGHT_LOADER_V2``), an architecture in :data:`VERIFIED_ARCHITECTURES`, no LoRA
layer, and only unquantized layers (an online-FP8 engine takes
:mod:`rlinfer_sglang.scheduler.fp8_load`, which quantizes the update into the served codes, or
else :func:`~rlinfer_sglang.scheduler.requantize.requantizing` around ``load_weights``). For
those, checked against SGLang 0.5.23's source, ``load_weights`` does nothing
but copy each checkpoint tensor into a slice of a parameter:

- ``models/{llama,qwen2,qwen3}.py`` ``_legacy_load_weights``/``load_weights`` map ``q/k/v_proj``
  to ``qkv_proj`` (shard ``"q"``/``"k"``/``"v"``) and ``gate/up_proj`` to ``gate_up_proj``
  (shard 0/1), skip ``rotary_emb.*`` buffers, and call the parameter's ``weight_loader``;
- ``layers/linear.py``: ``QKVParallelLinear.weight_loader`` and
  ``MergedColumnParallelLinear.weight_loader`` narrow the parameter to the shard's rows (the
  layer's ``output_sizes`` at TP 1) and ``copy_``; ``RowParallelLinear.weight_loader`` copies
  whole at TP 1; their ``_is_cpu`` branches (padding) are not taken on CUDA;
- ``layers/vocab_parallel_embedding.py`` ``VocabParallelEmbedding.weight_loader`` (also the
  untied ``ParallelLMHead``'s) copies into the first ``org_vocab_size`` rows and zero-fills the
  rest: the plan zeroes those rows too (:class:`~rlinfer_core.transfer.fast_load.SlicePlan`);
- norms and everything else: ``model_loader/weight_utils.py`` ``default_weight_loader`` copies
  (Gemma's norms have their own loader that adds 1: Gemma is not verified, and a parameter whose
  loader is not one of :data:`PLAIN_LOADERS` gets no slice);
- a tied head (``tie_word_embeddings``) is the embedding module; Llama skips ``lm_head.weight``,
  Qwen2/3 find no such parameter: the plan skips it too. Where a tied model still has a separate
  ``lm_head.weight`` parameter (Qwen2/3 then also load the embedding into it), the embedding gets
  no slice and such updates take ``load_weights``;
- the custom loader is called by ``WeightUpdater.update_weights_from_tensor`` with nothing after
  it (no ``process_weights_after_loading``), and ``UnquantizedLinearMethod`` repacks on CPU only.

Slices come from :func:`rlinfer_sglang.scheduler.loader._served` (the checksums' map of HF names
onto served tensors) over the names and shapes the model's own layers imply
(:func:`checkpoint_shapes`), so the plan needs no checkpoint and is built once per model
(rebuilt if a parameter's memory changes, e.g. a release that did not keep addresses). The GPU
bundle's SGLang may be another release: its served weights are verified by checksum after each
round trip of the GPU bench.

``RLINFER_SGLANG_FAST_LOAD=0`` in the engine's environment turns it off (A/B comparisons), and
the fast FP8 path with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from rlinfer_core.transfer.fast_load import SlicePlan

#: switch: "0", "false", "no" or "off" turn the fast path off
ENV = "RLINFER_SGLANG_FAST_LOAD"

#: model classes whose ``load_weights`` only copies into parameter slices on CUDA (SGLang 0.5.23)
VERIFIED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
#: quant methods whose layers' weight loaders copy the tensor as it is
PLAIN_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
#: parameter weight loaders (``__qualname__``) verified to copy into a slice at TP 1 on CUDA
PLAIN_LOADERS = frozenset(
    {
        "default_weight_loader",
        "ColumnParallelLinear.weight_loader",
        "MergedColumnParallelLinear.weight_loader",
        "QKVParallelLinear.weight_loader",
        "RowParallelLinear.weight_loader",
        "VocabParallelEmbedding.weight_loader",
    }
)

log = logging.getLogger("rlinfer_sglang.scheduler")


def enabled_by_env() -> bool:
    """Whether :data:`ENV` leaves the fast path on (the default)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def ineligible_reason(
    model: Any, device_type: str, tp_size: int, pp_size: int, loader_v2: bool, methods: frozenset[str] = PLAIN_METHODS
) -> str | None:
    """Why this engine's updates can never be loaded fast (None: they can, given a plan); ``methods``:
    the quant methods a layer may have (the FP8 path, :mod:`rlinfer_sglang.scheduler.fp8_load`,
    allows its own)."""
    if not enabled_by_env():
        return f"{ENV} turns it off"
    if device_type != "cuda":
        return f"device {device_type} (SGLang's CPU kernels repack their weights)"
    if tp_size != 1 or pp_size != 1:
        return "tensor or pipeline parallelism (each rank loads a shard)"
    if loader_v2:
        return "SGLANG_ENABLE_WEIGHT_LOADER_V2 (that load_weights is not verified)"
    name = type(model).__name__
    if name not in VERIFIED_ARCHITECTURES:
        return f"{name}: load_weights not verified to be plain copies"
    for module in model.modules():
        if type(module).__name__.endswith("WithLoRA"):
            return "LoRA (layers are wrapped)"
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in methods:
            return f"quantized ({type(method).__name__})"
    return None


def engine_reason(model: Any, methods: frozenset[str] = PLAIN_METHODS) -> str | None:
    """:func:`ineligible_reason` for the engine this scheduler runs."""
    from sglang.srt.distributed import parallel_state

    from rlinfer_sglang.scheduler.loader import _device

    sizes = []
    for read in ("get_tensor_model_parallel_world_size", "get_pipeline_model_parallel_world_size"):
        try:
            sizes.append(int(getattr(parallel_state, read)()))
        except Exception:  # not initialised (single rank)
            sizes.append(1)
    try:
        from sglang.srt.environ import envs

        loader_v2 = bool(envs.SGLANG_ENABLE_WEIGHT_LOADER_V2.get())
    except (ImportError, AttributeError):  # a release without the switch: only the one loader
        loader_v2 = False
    return ineligible_reason(model, _device(model).type, sizes[0], sizes[1], loader_v2, methods)


def _loader_name(param: Any) -> str:
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        return "default_weight_loader"  # what the models' load_weights use then
    return str(getattr(getattr(loader, "__func__", loader), "__qualname__", ""))


def checkpoint_shapes(model: Any) -> dict[str, tuple[str, list[int]]]:
    """HF name -> (the parameter ``load_weights`` writes it into, its shape), for every name the
    model's parameters take at TP 1: a fused layer's parts by its ``output_sizes``, a padded
    vocabulary's ``org_vocab_size`` rows, every other parameter whole."""
    from rlinfer_sglang.scheduler.loader import _FUSED

    out: dict[str, tuple[str, list[int]]] = {}
    for name, param in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        fused = next(((f, parts) for f, parts in _FUSED if f".{f}." in f".{name}"), None)
        if fused is not None:
            sizes = [int(s) for s in getattr(module, "output_sizes", ())]
            if len(sizes) == len(fused[1]) and param.dim() and sum(sizes) == param.shape[0]:
                for part, size in zip(fused[1], sizes, strict=True):
                    out[name.replace(f".{fused[0]}.", f".{part}.")] = (name, [size, *param.shape[1:]])
            continue  # otherwise not the layout verified: its parts get no slice
        rows = getattr(module, "org_vocab_size", None)
        if rows is not None and attr == "weight" and param.dim() == 2 and int(rows) <= param.shape[0]:
            out[name] = (name, [int(rows), *param.shape[1:]])
        else:
            out[name] = (name, list(param.shape))
    return out


def parameter_views(model: Any) -> SlicePlan:
    """Where ``load_weights`` writes each HF name (see the module docstring): the slices, the
    names it skips, and the padding rows it zero-fills."""
    from rlinfer_core.transfer.fast_load import SlicePlan, drop_overlaps, parameter_storages
    from rlinfer_sglang.scheduler.loader import _served

    params = dict(model.named_parameters())
    owners = checkpoint_shapes(model)
    shapes = {name: shape for name, (_, shape) in owners.items()}
    storages = parameter_storages(model)
    views: dict[str, torch.Tensor] = {}
    zeroed: dict[str, torch.Tensor] = {}
    for name, (owner, shape) in owners.items():
        if _loader_name(params[owner]) not in PLAIN_LOADERS:
            continue
        tensor = _served(model, params, name, shapes)
        if tensor is None or tensor.numel() == 0 or not tensor.is_contiguous():
            continue
        if tensor.untyped_storage().data_ptr() not in storages:
            continue
        views[name] = tensor.detach()
        whole = params[owner]
        if owner == name and whole.dim() and len(shape) and whole.shape[0] > shape[0]:  # scalars: FP8 KV scales
            zeroed[name] = whole.detach()[shape[0] :]
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and "lm_head.weight" in params:  # Qwen2/3 would load the embedding into it as well
        views.pop("model.embed_tokens.weight", None)
    views = drop_overlaps(views)
    skipped = frozenset({"lm_head.weight"}) if tied else frozenset()
    return SlicePlan(views, skipped, {name: pad for name, pad in zeroed.items() if name in views})


def plan_report(model: Any) -> dict[str, Any]:
    """Why updates are not loaded fast here (``reason``, None: they are; ``fp8_reason``: the same
    for the fast FP8 path, :mod:`rlinfer_sglang.scheduler.fp8_load`) and the plan the model's
    module tree gives (``mapped``, ``skipped``, ``zeroed``: sorted names), whatever the reason."""
    from rlinfer_sglang.scheduler import fp8_load

    plan = parameter_views(model)
    return {
        "reason": engine_reason(model),
        "fp8_reason": fp8_load.engine_reason(model),
        "mapped": sorted(plan.views),
        "skipped": sorted(plan.skipped),
        "zeroed": sorted(plan.zeroed),
    }


class Loader(Protocol):
    """What :class:`SchedulerPath` drives: the core's ``FastLoader`` or ``Fp8FastLoader``."""

    @property
    def plan_s(self) -> float:
        """Seconds the last load spent building the plan."""

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Load ``tensors`` and return True, or write nothing and return False."""


class SchedulerPath:
    """One fast path of a scheduler process (``what``, in the log): whether its engine is eligible
    (``reason``, checked once per model, the reason logged once where ``worth_logging`` says so)
    and its loader (``make_loader(get_model)``, cached by the core)."""

    def __init__(
        self,
        what: str,
        reason: Callable[[Any], str | None],
        make_loader: Callable[[Callable[[], Any]], Loader],
        worth_logging: Callable[[Any], bool] = lambda model: True,
    ) -> None:
        self._what, self._reason_of, self._worth_logging = what, reason, worth_logging
        self._model: Any = None
        self._reason: tuple[Any, str | None] | None = None
        self._loader = make_loader(lambda: self._model)

    @property
    def plan_s(self) -> float:
        """Seconds the last :meth:`load` spent building the plan (0.0 when cached)."""
        return self._loader.plan_s

    def load(self, model: Any, tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Load ``tensors`` into ``model`` and return True, or write nothing and return False
        (ineligible engine, or an update the loader does not take): the caller's usual path."""
        if self._reason is None or self._reason[0] is not model:
            reason = self._reason_of(model)
            if reason is not None and self._worth_logging(model):
                log.info("%s off: %s", self._what, reason)
            self._reason = (model, reason)
        if self._reason[1] is not None:
            return False
        self._model = model
        return self._loader.load(tensors)


#: this scheduler process's fast paths, by name
_PROCESS: dict[str, SchedulerPath] = {}


def loaded_by(name: str, make: Callable[[], SchedulerPath], model: Any, tensors: Sequence[Any]) -> tuple[bool, float]:
    """:meth:`SchedulerPath.load` of this process's path ``name`` (made once by ``make``), and its
    plan time (seconds)."""
    path = _PROCESS.get(name)
    if path is None:
        path = _PROCESS[name] = make()
    return path.load(model, tensors), path.plan_s


def _bf16_path() -> SchedulerPath:
    from rlinfer_core.transfer.fast_load import FastLoader

    return SchedulerPath("fast weight loading", engine_reason, lambda get_model: FastLoader(get_model, parameter_views))


def loaded_fast(model: Any, tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[bool, float]:
    """The BF16 fast path (one batched copy) of this process: loaded or not, and its plan time."""
    return loaded_by("bf16", _bf16_path, model, tensors)
