"""A trainer's parameter names onto the checkpoint's, for mixtures of experts.

Engines name weights as the checkpoint does (:attr:`AsyncEngine.weight_specs`). A trainer holding
the model in transformers >= 5 names a layer's experts differently: one fused tensor per
projection, ``<p>.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up
rows) and ``<p>.experts.down_proj`` ``[E, H, I]``, where the checkpoint has
``<p>.experts.<e>.gate_proj.weight`` ... (Mixtral's ``w1``/``w3``/``w2``); and some layouts rename
modules in memory (Mixtral's ``block_sparse_moe`` is ``mlp``). A vision-language checkpoint
(Qwen2-VL layout: ``visual.*`` beside ``model.*``) is nested in memory: ``model.visual.*`` and
``model.language_model.*`` (``VLM_PREFIXES``; ``lm_head`` stays).

:func:`name_map` reads the checkpoint-side layout from the specs once;
:meth:`NameMap.to_checkpoint` turns a trainer's ``(name, tensor)`` pairs into checkpoint pairs
(expert slices are views: nothing is copied), and :meth:`NameMap.manifest_to_checkpoint` does the
same for a bucket's manifest (an expert's slice of a fused tensor is contiguous, so it becomes an
entry of its own over the same bytes). Names the map does not know pass through unchanged, so
validation still reports them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, assert_never

import attrs

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.weights import (
    BroadcastSource,
    BucketManifest,
    Buckets,
    CheckpointDir,
    ManifestEntry,
    NamedTensors,
    TensorSpec,
    WeightSource,
)

#: checkpoint module name -> its name in a transformers >= 5 model
MODULE_RENAMES: Mapping[str, str] = {"block_sparse_moe": "mlp"}
#: checkpoint prefix -> its name in a transformers >= 5 vision-language model (Qwen2-VL family),
#: applied when the checkpoint has a top-level ``visual`` module; the first match wins
VLM_PREFIXES: tuple[tuple[str, str], ...] = (("visual.", "model.visual."), ("model.", "model.language_model."))
#: the checkpoint's (gate, up, down) projection names of one expert
EXPERT_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: the fused names of a transformers >= 5 experts module
FUSED_GATE_UP = "gate_up_proj"
FUSED_DOWN = "down_proj"

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<projection>\w+)\.weight$")


@attrs.frozen
class ExpertGroup:
    """One layer's experts as the checkpoint names them."""

    prefix: str  #: ``model.layers.0.mlp.experts``
    count: int
    gate: str
    up: str
    down: str

    def name(self, index: int, projection: str) -> str:
        """The checkpoint name of one expert's projection."""
        return f"{self.prefix}.{index}.{projection}.weight"


@attrs.frozen
class NameMap:
    """Trainer names that are not checkpoint names, and what they stand for."""

    renamed: Mapping[str, str] = attrs.field(factory=dict)  #: trainer name -> checkpoint name
    fused: Mapping[str, tuple[ExpertGroup, str]] = attrs.field(factory=dict)  #: -> (group, "gate_up"|"down")

    def __bool__(self) -> bool:
        return bool(self.renamed or self.fused)

    def to_checkpoint(self, pairs: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``pairs`` under checkpoint names (fused experts split into views)."""
        out: list[tuple[str, Any]] = []
        for name, tensor in pairs:
            target = self.fused.get(name)
            if target is None or getattr(tensor, "dim", lambda: 0)() != 3 or tensor.shape[0] != target[0].count:
                out.append((self.renamed.get(name, name), tensor))
                continue
            group, kind = target
            for index in range(group.count):
                if kind == "down":
                    out.append((group.name(index, group.down), tensor[index]))
                    continue
                half = tensor.shape[1] // 2
                out.append((group.name(index, group.gate), tensor[index, :half]))
                out.append((group.name(index, group.up), tensor[index, half:]))
        return out

    def manifest_to_checkpoint(self, manifest: BucketManifest) -> BucketManifest:
        """``manifest`` with its entries under checkpoint names (same bytes, same checksum)."""
        if not any(e.name in self.fused or e.name in self.renamed for e in manifest.entries):
            return manifest
        entries: list[ManifestEntry] = []
        for entry in manifest.entries:
            target = self.fused.get(entry.name)
            if target is None or len(entry.shape) != 3 or entry.shape[0] != target[0].count:
                entries.append(attrs.evolve(entry, name=self.renamed.get(entry.name, entry.name)))
                continue
            group, kind = target
            rows, cols = entry.shape[1], entry.shape[2]
            per_expert = entry.nbytes // group.count
            for index in range(group.count):
                start = entry.offset + index * per_expert
                if kind == "down":
                    entries.append(
                        ManifestEntry(group.name(index, group.down), entry.dtype, (rows, cols), start, per_expert)
                    )
                    continue
                half = per_expert // 2
                shape = (rows // 2, cols)
                entries.append(ManifestEntry(group.name(index, group.gate), entry.dtype, shape, start, half))
                entries.append(ManifestEntry(group.name(index, group.up), entry.dtype, shape, start + half, half))
        return attrs.evolve(manifest, entries=tuple(entries))


def _trainer_name(checkpoint_name: str, vlm: bool = False) -> str:
    if vlm:
        for prefix, nested in VLM_PREFIXES:
            if checkpoint_name.startswith(prefix):
                checkpoint_name = nested + checkpoint_name.removeprefix(prefix)
                break
    parts = checkpoint_name.split(".")
    return ".".join(MODULE_RENAMES.get(p, p) for p in parts)


def expert_groups(names: Iterable[str]) -> list[ExpertGroup]:
    """The MoE layers among checkpoint tensor ``names``, each with its experts' projection names."""
    projections: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for name in names:
        match = _EXPERT.match(name)
        if match is not None:
            prefix = match["prefix"]
            projections.setdefault(prefix, set()).add(match["projection"])
            counts[prefix] = max(counts.get(prefix, 0), int(match["index"]) + 1)
    groups = []
    for prefix, seen in projections.items():
        for gate, up, down in EXPERT_PROJECTIONS:
            if seen == {gate, up, down}:
                groups.append(ExpertGroup(prefix, counts[prefix], gate, up, down))
    return groups


def name_map(specs: Mapping[str, TensorSpec] | Iterable[str]) -> NameMap:
    """The trainer names of a checkpoint whose tensors are ``specs`` (empty for dense layouts)."""
    names = list(specs)
    vlm = any(n.startswith(VLM_PREFIXES[0][0]) for n in names)
    fused: dict[str, tuple[ExpertGroup, str]] = {}
    for group in expert_groups(names):
        trainer_prefix = _trainer_name(group.prefix, vlm)
        fused[f"{trainer_prefix}.{FUSED_GATE_UP}"] = (group, "gate_up")
        fused[f"{trainer_prefix}.{FUSED_DOWN}"] = (group, "down")
    renamed = {_trainer_name(n, vlm): n for n in names if _trainer_name(n, vlm) != n and _EXPERT.match(n) is None}
    return NameMap(renamed, fused)


def under_checkpoint_names(source: WeightSource, names: NameMap) -> WeightSource:
    """``source`` with a trainer's tensors under checkpoint names: named tensors and buckets are
    mapped; a checkpoint directory or a broadcast under trainer names is refused with a hint
    (their tensors are read or received where the engine loads, after this process)."""
    if not names:
        return source
    match source:
        case NamedTensors():
            return NamedTensors(tuple(names.to_checkpoint(source.tensors)))
        case Buckets():
            return Buckets(
                tuple(attrs.evolve(b, manifest=names.manifest_to_checkpoint(b.manifest)) for b in source.buckets)
            )
        case CheckpointDir():
            from rlinfer_core.transfer.disk import read_specs

            _refuse_trainer_names("checkpoint directory", list(read_specs(source.path)), names)
            return source
        case BroadcastSource():
            _refuse_trainer_names("broadcast", [s.name for s in source.specs], names)
            return source
        case _:
            assert_never(source)


def _refuse_trainer_names(transport: str, carried: list[str], names: NameMap) -> None:
    trainer_only = [n for n in carried if n in names.fused or n in names.renamed]
    if trainer_only:
        raise WeightUpdateError(
            f"{transport} updates carry checkpoint names; these are a trainer's (transformers >= 5) "
            "names: convert them with engine.checkpoint_names(tensors) (or save with save_pretrained) first",
            tuple(f"{n}: trainer name" for n in trainer_only),
        )
