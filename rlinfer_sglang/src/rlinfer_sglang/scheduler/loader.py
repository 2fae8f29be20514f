"""Code that runs inside SGLang's scheduler process (one per tensor-parallel rank).

SGLang calls :func:`load` as a *custom weight loader* (``ServerArgs.custom_weight_loader``):
``update_weights_from_tensor(..., load_format="rlinfer_sglang.scheduler.loader.load")`` hands it
the model and the deserialized ``(name, tensor)`` pairs. The first pair is a control record
(``CONTROL`` -> JSON bytes as a uint8 tensor) saying what to do:

- ``tensors``: the other pairs are the weights (shared memory on CPU, CUDA IPC on GPU).
- ``buckets``: the other pairs are the core's packed buckets; ``manifests`` describes them;
  with ``keep``, CUDA ones stay mapped until the next update (the sender's arena reuses them).
- ``disk``: read every tensor of the safetensors directory ``path``.
- ``join``: join the trainer's torch.distributed group ``group`` (rlinfer_core's own group
  builder, so both ends build the same group) as rank 1 + tensor-parallel rank.
- ``broadcast``: receive ``specs`` from rank 0 of group ``group_name``.
- ``checksum``: checksums of the served parameters, mapped back to the HF names ``specs``.
- ``fast_plan``: what :mod:`rlinfer_sglang.scheduler.fast_load` makes of this engine (tests).
- ``release_mapped``: drop the CUDA buckets kept mapped since the last ``buckets`` update (at
  shutdown, so that the sender can free them: ``rlinfer_core.transfer.arena.PackArena.close``).

Where :mod:`rlinfer_sglang.scheduler.fast_load` finds the engine eligible, an update is loaded by
one batched copy into the parameters instead of ``model.load_weights`` (outcome ``fast_load``:
1.0, else 0.0; ``fast_plan_s``: seconds spent finding the slices, 0 once cached). On an online-FP8
engine, :mod:`rlinfer_sglang.scheduler.fp8_load` quantizes the update straight into the served
codes where it can (outcome ``fast_fp8``: 1.0, else 0.0, present where the BF16 fast path did not
load); otherwise :mod:`rlinfer_sglang.scheduler.requantize` re-quantizes after ``load_weights``.

After loading, the outcome holds ``lengths``: rid -> ``len(output_ids)`` of every request the
scheduler holds at that moment (the per-token weight versions, see :mod:`rlinfer_sglang.versions`);
with ``rekey`` in the control record, every request without KV then gets that radix-cache key.

Everything is read *before* any weight is loaded, and broadcast tensors (which the caller's
facade cannot see) are checked for finite values first, so a rejected update leaves the old
weights in place; the facade validated the other transports before they were sent.

SGLang ignores a custom loader's result and treats an exception as fatal for the scheduler, so
:func:`load` never raises: it writes its outcome as JSON to ``result`` + ``.<tp rank>``, which
the backend reads after the call.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlinfer_core.checksum import WeightChecksum

CONTROL = "__rlinfer_control__"

#: weight groups this scheduler process joined, by group name
_GROUPS: dict[str, Any] = {}


def encode_control(control: dict[str, Any]) -> tuple[str, torch.Tensor]:
    """The control record as a (name, uint8 tensor) pair."""
    import torch

    raw = json.dumps(control).encode()
    return CONTROL, torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _decode_control(tensor: torch.Tensor) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())
    return data


def _tp_rank() -> int:
    # parallel_state has it in every SGLang; 0.5.2x no longer re-exports it (deprecated) from
    # sglang.srt.distributed, where an ImportError made every rank report as rank 0
    from sglang.srt.distributed import parallel_state

    try:
        return int(parallel_state.get_tensor_model_parallel_rank())
    except Exception:  # not initialised (single rank)
        return 0


def _device(model: Any) -> torch.device:
    import torch

    for param in model.parameters():
        return torch.device(param.device)
    return torch.device("cpu")


def _check_finite(tensors: list[tuple[str, torch.Tensor]]) -> None:
    from rlinfer_core.errors import WeightUpdateError
    from rlinfer_core.transfer.validate import nonfinite_problems

    problems = nonfinite_problems(tensors)
    if problems:
        raise WeightUpdateError("weight update rejected", tuple(problems))


def _gather(
    model: Any, control: dict[str, Any], pairs: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    op = control["op"]
    if op == "tensors":
        return pairs
    if op == "buckets":
        from rlinfer_core.transfer.buckets import unpack_all
        from rlinfer_core.weights import Bucket, BucketManifest, ManifestEntry

        buckets = []
        for manifest, (_, data) in zip(control["manifests"], pairs, strict=True):
            entries = tuple(ManifestEntry(**e) for e in manifest["entries"])
            m = BucketManifest(manifest["dtype"], manifest["nbytes"], entries, manifest["checksum"])
            buckets.append(Bucket(m, data))
        return unpack_all(buckets, check=False)  # the caller's facade verified them before sending
    if op == "disk":
        from rlinfer_core.transfer.disk import read_checked

        return read_checked(control["path"], _device(model))  # the facade checked the headers only
    if op == "broadcast":
        from rlinfer_core.transfer.broadcast import receive
        from rlinfer_core.weights import TensorSpec

        pg = _GROUPS.get(control["group_name"])
        if pg is None:
            raise RuntimeError(f"no weight group {control['group_name']!r}; call init_weight_broadcast first")
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in control["specs"]]
        tensors = receive(pg, specs, device=_device(model))
        _check_finite(tensors)
        return tensors
    raise ValueError(f"unknown rlinfer weight op {op!r}")


def _join(control: dict[str, Any]) -> None:
    from rlinfer_core.transfer.broadcast import create_group, destroy_group
    from rlinfer_core.weights import BroadcastGroup

    group = BroadcastGroup(**control["group"])
    old = _GROUPS.pop(group.group_name, None)
    if old is not None:
        destroy_group(old)
    _GROUPS[group.group_name] = create_group(group, rank=group.rank_offset + _tp_rank())


def _scheduler() -> Any:
    """SGLang's Scheduler object: the caller of this loader, up the stack (same thread)."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and hasattr(obj, "waiting_queue") and hasattr(obj, "running_batch"):
            return obj
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _without_kv(scheduler: Any) -> list[Any]:
    """Requests the scheduler holds that have no KV of their own now (waiting for a prefill,
    retracted by a pause, or waiting for their grammar): all of them compute it after a load."""
    grammar = getattr(getattr(scheduler, "grammar_manager", None), "grammar_queue", None) or ()
    chunked = getattr(scheduler, "chunked_req", None)
    return [req for req in (*scheduler.waiting_queue, *grammar) if req is not chunked]


def rekey(key: str) -> int:
    """Give every request without KV the radix-cache key ``key`` in place of rlinfer's older one
    (:func:`rlinfer_sglang.requests.rekeyed`); SGLang matches a request's prefix when it schedules
    its prefill, so they match only what the new weights computed. Returns how many changed."""
    from rlinfer_sglang.requests import rekeyed

    scheduler = _scheduler()
    changed = 0
    for req in _without_kv(scheduler) if scheduler is not None else ():
        new = rekeyed(req.extra_key, key)
        if new != req.extra_key:
            req.extra_key, changed = new, changed + 1
    return changed


def output_lengths() -> dict[str, int] | None:
    """rid -> tokens produced so far, for every request the scheduler holds (None: not found)."""
    scheduler = _scheduler()
    if scheduler is None:
        return None
    reqs = _without_kv(scheduler)
    for batch in (scheduler.running_batch, getattr(scheduler, "last_batch", None)):
        reqs.extend(getattr(batch, "reqs", None) or ())
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        reqs.append(chunked)
    lengths: dict[str, int] = {}
    for req in reqs:
        lengths[req.rid] = max(lengths.get(req.rid, 0), len(req.output_ids))
    return lengths


#: fused SGLang parameters and the HF parameters they hold, in order along dim 0
_FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
#: HF name parts SGLang renames without changing the tensor (Qwen2-VL's vision attention: the
#: checkpoint's fused ``attn.qkv`` is SGLang's VisionAttention ``attn.qkv_proj``, same q/k/v rows)
_RENAMED = ((".attn.qkv.", ".attn.qkv_proj."),)


def _served(model: Any, params: dict[str, Any], name: str, shapes: dict[str, list[int]]) -> Any:
    """The tensor the engine serves for HF parameter ``name`` (a view), or None."""
    tensor = params.get(name)
    for part, served in _RENAMED:
        if tensor is None and part in name:
            tensor = params.get(name.replace(part, served))
    if tensor is None and name == "lm_head.weight":
        head = getattr(model, "lm_head", None)  # tied: the embedding module itself
        tensor = getattr(head, "weight", None)
    if tensor is None:
        for fused, parts in _FUSED:
            for i, part in enumerate(parts):
                if f".{part}." not in name:
                    continue
                whole = params.get(name.replace(f".{part}.", f".{fused}."))
                sizes = [shapes.get(name.replace(f".{part}.", f".{p}."), [0])[0] for p in parts]
                if whole is not None and all(sizes):
                    tensor = whole.narrow(0, sum(sizes[:i]), sizes[i])
    if tensor is None:
        return None
    shape = shapes[name]
    if list(tensor.shape) != shape and tensor.dim() == len(shape) and tensor.shape[0] > shape[0]:
        tensor = tensor.narrow(0, 0, shape[0])  # vocabulary padded by the engine
    return tensor if list(tensor.shape) == shape else None


#: model classes whose ``load_weights`` stores RMSNorm weights as ``1 + w`` (SGLang's Gemma)
PLUS_ONE_NORMS = frozenset({"GemmaForCausalLM"})


def _served_experts(params: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """HF name -> the expert weight SGLang serves, from each MoE layer's fused ``w13_weight``
    ``[E, 2I, H]`` (gate rows, then up rows) and ``w2_weight`` ``[E, H, I]``."""
    from rlinfer_core.trainer_names import expert_groups

    out: dict[str, Any] = {}
    for group in expert_groups(names):
        w13, w2 = params.get(f"{group.prefix}.w13_weight"), params.get(f"{group.prefix}.w2_weight")
        if w13 is None or w2 is None or w13.shape[0] != group.count or w2.shape[0] != group.count:
            continue
        size = int(w13.shape[1]) // 2
        for index in range(group.count):
            out[group.name(index, group.gate)] = w13[index, :size]
            out[group.name(index, group.up)] = w13[index, size:]
            out[group.name(index, group.down)] = w2[index]
    return out


def _checksums(model: Any, specs: list[list[Any]]) -> dict[str, list[Any]]:
    """[dtype, shape, digest, added] of every spec name the engine serves (see
    :class:`rlinfer_core.checksum.WeightChecksum`); read by :func:`served_checksums`."""
    from rlinfer_core.checksum import tensor_checksums

    params = dict(model.named_parameters())
    shapes = {name: list(shape) for name, shape in specs}
    experts = _served_experts(params, list(shapes))
    plus_one = type(model).__name__ in PLUS_ONE_NORMS
    found: dict[str, Any] = {}
    for name in shapes:
        tensor = experts.get(name)
        if tensor is None or list(tensor.shape) != shapes[name]:
            tensor = _served(model, params, name, shapes)
        if tensor is not None:
            found[name] = tensor
    sums = tensor_checksums([(tensor, None, 0.0, None) for tensor in found.values()])
    return {
        name: [c.dtype, list(c.shape), c.digest, 1.0 if plus_one and name.endswith("norm.weight") else 0.0]
        for name, c in zip(found, sums, strict=True)
    }


def served_checksums(outcome: dict[str, Any]) -> dict[str, WeightChecksum]:
    """The checksum op's outcome as checksums by HF name."""
    from rlinfer_core.checksum import WeightChecksum

    return {
        name: WeightChecksum(d, tuple(shape), digest, added)
        for name, (d, shape, digest, added) in outcome["checksums"].items()
    }


def _private_vectors(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """One-dimensional tensors (norms, biases: tiny) copied, because a model's loader may change
    what it is given in place (SGLang's Gemma adds 1 to its norm weights), and a tensor shared by
    the trainer (shared memory, CUDA IPC) is the trainer's own parameter."""
    return [(name, t.clone() if t.dim() <= 1 else t) for name, t in tensors]


def _forget_vision_embeddings() -> None:
    """Empty SGLang's cache of image embeddings (vision tower outputs by image hash): it outlives
    weight updates and flush_cache (SGLang 0.5.23), so an image seen before an update would be
    served with the old vision tower's features (measured: the kit's tiny VLM after a round trip
    of updates generated the previous weights' tokens for a cached image)."""
    import importlib

    # where the cache lives: mm_schedule (0.5.23), mm_utils (older releases)
    for module_name in ("sglang.srt.managers.mm_schedule", "sglang.srt.managers.mm_utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cache = getattr(module, "embedding_cache", None)
        if cache is not None and hasattr(cache, "clear"):
            cache.clear()


def load(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader entry point; never raises (see the module docstring)."""
    outcome: dict[str, Any] = {"ok": False, "loaded": False, "error": "no control record"}
    control: dict[str, Any] = {}
    try:
        if not named_tensors or named_tensors[0][0] != CONTROL:
            raise ValueError("the first tensor must be the rlinfer control record")
        control = _decode_control(named_tensors[0][1])
        if control["op"] == "join":
            _join(control)
        elif control["op"] == "checksum":
            outcome["checksums"] = _checksums(model, control["specs"])
        elif control["op"] == "fast_plan":
            from rlinfer_sglang.scheduler.fast_load import plan_report

            outcome["fast_plan"] = plan_report(model)
        elif control["op"] == "release_mapped":
            from rlinfer_core.transfer.ipc import keep_mapped

            keep_mapped(())
        else:
            started = time.perf_counter()
            tensors = _gather(model, control, list(named_tensors[1:]))
            if control["op"] == "buckets":
                from rlinfer_core.transfer.ipc import keep_mapped

                kept = [t for _, t in named_tensors[1:]] if control.get("keep") else []
                outcome["ipc_reused"] = keep_mapped(kept)
            outcome["map_s"] = time.perf_counter() - started
            outcome["loaded"] = True  # from here on a failure may leave a partial update
            from rlinfer_core.fault_plan import planted
            from rlinfer_sglang.scheduler.fast_load import loaded_fast
            from rlinfer_sglang.scheduler.fp8_load import loaded_fast_fp8
            from rlinfer_sglang.scheduler.requantize import requantizing

            tensors = list(planted(tensors))
            fast, outcome["fast_plan_s"] = loaded_fast(model, tensors)  # one batched copy where verified
            outcome["fast_load"] = 1.0 if fast else 0.0
            if not fast:  # an online-FP8 engine: quantized straight into its codes where verified
                fast, fp8_plan_s = loaded_fast_fp8(model, tensors)
                outcome["fast_fp8"] = 1.0 if fast else 0.0
                outcome["fast_plan_s"] += fp8_plan_s
            if not fast:
                with requantizing(model):  # an online-FP8 engine quantizes the BF16 update again
                    model.load_weights(_private_vectors(tensors))
            _forget_vision_embeddings()
            if _device(model).type == "cuda":
                import torch

                # the sender frees (or reuses) its buffers once this call returns
                torch.cuda.current_stream().synchronize()
            outcome["load_s"] = time.perf_counter() - started - outcome["map_s"]
            outcome["lengths"] = output_lengths()
            if control.get("rekey"):  # the new version's requests never match what older weights cached
                outcome["rekeyed"] = rekey(control["rekey"])
        outcome.update(ok=True, error=None)
    except Exception as exc:  # reported to the caller through the result file
        outcome["error"] = f"{type(exc).__name__}: {exc}"
        outcome["traceback"] = traceback.format_exc(limit=-10)  # the innermost frames
    result = control.get("result")
    if result:
        Path(f"{result}.{_tp_rank()}").write_text(json.dumps(outcome))
