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
tensor has a slice on its device in its dtype (:meth:`FastLoader.load`); otherwise the caller
uses ``load_weights`` as before.

``RLINFER_VLLM_FAST_LOAD=0`` in the engine's environment turns it off (A/B comparisons).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

#: switch: "0", "false", "no" or "off" turn the fast path off
ENV = "RLINFER_VLLM_FAST_LOAD"

#: model classes whose ``load_weights`` only copies into parameter slices on CUDA (unquantized)
VERIFIED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})

Specs = Mapping[str, "tuple[torch.dtype, tuple[int, ...]]"]


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


def _byte_span(view: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, end byte) of a contiguous view."""
    size = view.element_size()
    start = int(view.storage_offset()) * size
    return view.untyped_storage().data_ptr(), start, start + int(view.numel()) * size


def drop_overlaps(views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``views`` without every name whose bytes overlap another name's (one batched copy must
    write each byte once, and two names on the same bytes mean the engine ties them)."""
    spans = sorted((*_byte_span(v), name) for name, v in views.items())
    clash: set[str] = set()
    # sorted by start: a span overlaps an earlier one iff it starts before the furthest end so far
    furthest: dict[int, tuple[int, str]] = {}
    for ptr, start, end, name in spans:
        seen = furthest.get(ptr)
        if seen is not None and start < seen[0]:
            clash.update((name, seen[1]))
        if seen is None or end > seen[0]:
            furthest[ptr] = (end, name)
    return {name: v for name, v in views.items() if name not in clash}


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

    storages = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel() > 0}
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


def _fingerprint(model: Any) -> tuple[Any, ...]:
    """Changes when the model or any parameter's memory is replaced (a full reload)."""
    return (id(model), *((id(p), p.data_ptr()) for p in model.parameters()))


T = TypeVar("T")


class PerModel(Generic[T]):
    """What ``build`` makes of the model ``get_model`` returns, kept until the model or any of its
    parameters' memory is replaced (:func:`_fingerprint`, e.g. a full reload) or :meth:`invalidate`.
    ``plan_s``: seconds the last :meth:`get` spent building (0.0 when the value was kept)."""

    def __init__(self, get_model: Callable[[], Any], build: Callable[[Any], T]) -> None:
        self._get_model = get_model
        self._build = build
        self._value: tuple[T] | None = None
        self._key: tuple[Any, ...] | None = None
        self.plan_s = 0.0

    def invalidate(self) -> None:
        """Forget the value (and the references it may hold on the parameters' memory)."""
        self._value, self._key = None, None

    def get(self) -> T:
        """The value for the model as it is now."""
        import time

        model = self._get_model()
        key = _fingerprint(model)
        self.plan_s = 0.0
        if self._value is None or key != self._key:
            started = time.perf_counter()
            self.invalidate()
            self._value, self._key = (self._build(model),), key
            self.plan_s = time.perf_counter() - started
        return self._value[0]


class FastLoader:
    """The cached :func:`parameter_views` of one engine's model, and the batched load with it.

    ``get_model`` returns the model as it is now; the views are rebuilt when it or any of its
    parameters' memory changed since they were taken (:func:`_fingerprint`), or after
    :meth:`invalidate`.
    """

    def __init__(self, get_model: Callable[[], Any], specs: Specs, served_dtype: torch.dtype) -> None:
        self._specs = specs
        self._dtype = served_dtype
        self._plan = PerModel(get_model, self._build)

    def _build(self, model: Any) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        try:
            return parameter_views(model, self._specs, self._dtype), skipped_names(model, self._specs)
        except Exception:  # a layout this module does not know: every update takes load_weights
            logging.getLogger("rlinfer_vllm.worker").warning("fast load: no plan", exc_info=True)
            return {}, frozenset()

    @property
    def plan_s(self) -> float:
        """Seconds spent building the views at the last :meth:`views` call (0.0 when cached)."""
        return self._plan.plan_s

    def invalidate(self) -> None:
        """Forget the views (and the references they hold on the parameters' memory)."""
        self._plan.invalidate()

    def views(self) -> dict[str, torch.Tensor]:
        """The current views, rebuilt if the model's parameters changed."""
        return self._plan.get()[0]

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Copy every tensor into its slice with one ``torch._foreach_copy_`` and return True, or
        write nothing and return False when some tensor has no slice on its device in its dtype
        and shape. Tensors that ``load_weights`` skips are skipped. The copies are asynchronous:
        the caller synchronizes the stream."""
        import torch

        views, skipped = self._plan.get()
        dests, srcs = [], []
        for name, tensor in tensors:
            if name in skipped:
                continue
            dest = views.get(name)
            if dest is None or dest.device != tensor.device or dest.dtype != tensor.dtype:
                return False
            if dest.shape != tensor.shape:
                return False
            dests.append(dest)
            srcs.append(tensor)
        if dests:
            with torch.no_grad():
                torch._foreach_copy_(dests, srcs, non_blocking=True)
        return True
