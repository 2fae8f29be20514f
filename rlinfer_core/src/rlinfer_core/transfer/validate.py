"""Check a weight update against the engine's parameters before anything is loaded.

Every problem is collected (not just the first) and reported in one WeightUpdateError, so a
trainer sees all bad names/shapes/dtypes at once. Nothing here touches the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, assert_never

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.weights import (
    BroadcastSource,
    Buckets,
    CheckpointDir,
    NamedTensors,
    TensorSpec,
    WeightSource,
)

if TYPE_CHECKING:
    import torch

    from rlinfer_core.weights import Bucket


def spec_problems(incoming: Iterable[TensorSpec], expected: Mapping[str, TensorSpec]) -> list[str]:
    """Problems with names, shapes and dtypes (duplicates, unknown names, mismatches)."""
    problems = []
    seen: set[str] = set()
    for spec in incoming:
        if spec.name in seen:
            problems.append(f"{spec.name}: duplicate name in one update")
            continue
        seen.add(spec.name)
        want = expected.get(spec.name)
        if want is None:
            close = [n for n in expected if n.rsplit(".", 1)[-1] == spec.name.rsplit(".", 1)[-1]][:3]
            hint = f" (similar: {', '.join(close)})" if close else ""
            problems.append(f"{spec.name}: unknown parameter name{hint}")
            continue
        if tuple(spec.shape) != tuple(want.shape):
            problems.append(f"{spec.name}: shape {tuple(spec.shape)} != expected {tuple(want.shape)}")
        if spec.dtype != want.dtype:
            problems.append(f"{spec.name}: dtype {spec.dtype} != expected {want.dtype}")
    if not seen:
        problems.append("the update holds no tensors")
    return problems


def nonfinite_problems(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of floating-point tensors holding NaN or inf.

    One fused pass per device decides the common case (all finite) with one host sync: the L1
    norms of all tensors (``torch._foreach_norm``, a few kernels for the lot, accumulated in
    float32, float64 for float64 tensors), summed. NaN or inf anywhere makes that sum
    non-finite. Only then is each tensor checked on its own, to name the offenders (and to clear
    a sum that merely overflowed float32).
    """
    import torch

    floats = [(name, t) for name, t in tensors if t.is_floating_point() and t.numel()]
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, t in floats:
        accumulate = torch.float64 if t.dtype == torch.float64 else torch.float32
        groups.setdefault((t.device, accumulate), []).append(t.detach())
    suspect = False
    for (_, accumulate), group in groups.items():
        try:
            norms = torch._foreach_norm(group, ord=1, dtype=accumulate)
        except RuntimeError:  # a dtype the fused kernels lack (e.g. float8): check one by one
            suspect = True
            continue
        suspect |= not bool(torch.isfinite(torch.stack(norms).sum()))
    if not suspect:
        return []
    return [f"{name}: holds NaN or inf values" for name, t in floats if not bool(torch.isfinite(t).all())]


def packed_nonfinite_problems(buckets: Sequence[Bucket], tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """:func:`nonfinite_problems` of ``tensors`` after they were packed into ``buckets``, decided
    on the packed bytes: one sum per floating-point bucket (float32 accumulation, float64 for
    float64 buckets), a single reduction over contiguous memory, where a check per tensor reads
    hundreds of separate allocations. NaN or inf anywhere makes a sum non-finite; only then are
    the tensors checked one by one (:func:`nonfinite_problems`) to name the offenders."""
    import torch

    from rlinfer_core.transfer.buckets import to_dtype

    suspect = False
    sums = []
    for bucket in buckets:
        dtype = to_dtype(bucket.manifest.dtype)
        if not dtype.is_floating_point or bucket.data.numel() == 0:
            continue
        accumulate = torch.float64 if dtype == torch.float64 else torch.float32
        try:
            sums.append(torch.sum(bucket.data.view(dtype), dtype=accumulate))
        except RuntimeError:  # a dtype the reduction lacks (e.g. float8): check one by one
            suspect = True
    suspect = suspect or not all(bool(torch.isfinite(total)) for total in sums)
    return nonfinite_problems(tensors) if suspect else []


def _named_specs(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors]


def check_tensors(
    tensors: list[tuple[str, torch.Tensor]], expected: Mapping[str, TensorSpec], values: bool = True
) -> int:
    """Validate named tensors (``values``: their values too, see :func:`validate_source`);
    return their total size in bytes."""
    problems = spec_problems(_named_specs(tensors), expected)
    if values:
        problems += nonfinite_problems(tensors)
    if problems:
        raise WeightUpdateError("weight update rejected", tuple(problems))
    return sum(t.numel() * t.element_size() for _, t in tensors)


def validate_source(source: WeightSource, expected: Mapping[str, TensorSpec], *, values: bool = True) -> int:
    """Validate any weight source against ``expected``; return the bytes it carries.

    ``values=False`` leaves the finiteness of named tensors to the backend, which checks it
    while packing them (:func:`packed_nonfinite_problems`, before anything is loaded): the
    facade's own pass would read every byte once more.

    Checkpoint directories (by their safetensors headers) and broadcast sources are checked by
    spec only here; the backend checks the finiteness of what it reads or receives, where it
    lands, before loading any of it (:func:`rlinfer_core.transfer.disk.read_checked`): a second
    pass over the files on the host would cost as much as the engine's whole reload.
    """
    match source:
        case NamedTensors():
            return check_tensors(list(source.tensors), expected, values)
        case Buckets():
            from rlinfer_core.transfer.buckets import unpack_all

            return check_tensors(unpack_all(source.buckets, check=True), expected)
        case CheckpointDir():
            from rlinfer_core.transfer.disk import read_specs

            specs = read_specs(source.path)
            problems = spec_problems(specs.values(), expected)
            if problems:
                raise WeightUpdateError("weight update rejected", tuple(problems))
            from rlinfer_core.transfer.buckets import to_dtype

            return sum(s.numel * to_dtype(s.dtype).itemsize for s in specs.values())
        case BroadcastSource():
            problems = spec_problems(source.specs, expected)
            if problems:
                raise WeightUpdateError("weight update rejected", tuple(problems))
            from rlinfer_core.transfer.buckets import to_dtype

            return sum(s.numel * to_dtype(s.dtype).itemsize for s in source.specs)
        case _:
            assert_never(source)
