"""Integrity readback: checksums of the weights an engine really serves.

A backend that claims ``weights.checksum`` computes :func:`tensor_checksum` inside the engine,
over its own parameters mapped back to Hugging Face names (a fused ``qkv_proj`` sliced back into
``q_proj``/``k_proj``/``v_proj``; the output head reported as ``lm_head.weight`` even when it is
tied to the embedding). :meth:`rlinfer_core.engine.AsyncEngine.verify_weights` computes the same
checksum over the trainer's tensors, cast to the dtype the engine holds, and compares. Equal
digests mean bit-identical tensors; this catches an update that silently missed a parameter
without any reference model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core import _validate as v

if TYPE_CHECKING:
    import torch


@attrs.frozen
class WeightChecksum:
    """Dtype, shape and digest of one served tensor."""

    dtype: str  #: the dtype the engine holds the tensor in (torch name without ``torch.``)
    shape: tuple[int, ...] = attrs.field(converter=v.ints)
    digest: str  #: blake2b-128 hex digest of the tensor's bytes, row-major, in ``dtype``
    #: the engine serves the trainer's tensor plus this constant (e.g. SGLang's Gemma stores its
    #: RMSNorm weights as ``1 + w``): the trainer's tensor is compared after the same addition,
    #: in ``dtype``, so the comparison stays bit for bit
    added: float = 0.0


@attrs.frozen
class WeightVerification:
    """Outcome of :meth:`~rlinfer_core.engine.AsyncEngine.verify_weights`."""

    checked: tuple[str, ...]  #: names compared
    mismatched: tuple[str, ...]  #: names whose served bytes differ from the trainer's
    missing: tuple[str, ...]  #: trainer names the engine did not report

    @property
    def ok(self) -> bool:
        """True when every given tensor is served bit-identical."""
        return not self.mismatched and not self.missing


def tensor_checksum(tensor: torch.Tensor, dtype: str | None = None, added: float = 0.0) -> WeightChecksum:
    """Checksum of ``tensor`` cast to ``dtype`` (default: its own dtype), plus ``added`` (see
    :attr:`WeightChecksum.added`; the engine reports its served tensor with ``added=0``)."""
    import torch

    target = getattr(torch, dtype) if dtype else tensor.dtype
    data = tensor.detach().to(device="cpu", dtype=target).contiguous()
    if added:
        data = data + added
    raw = data.reshape(-1).view(torch.uint8) if data.numel() else data.reshape(-1)
    digest = hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()
    return WeightChecksum(str(target).removeprefix("torch."), tuple(tensor.shape), digest, added)


def verify(
    served: Mapping[str, WeightChecksum],
    tensors: Iterable[tuple[str, Any]] | Mapping[str, Any],
    tied: Mapping[str, str] | None = None,
) -> WeightVerification:
    """Compare the engine's checksums with the trainer's tensors.

    ``tied`` maps a served name to the trainer name that must equal it (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` for tied embeddings), so a tied head is checked too.
    """
    given = dict(tensors.items() if isinstance(tensors, Mapping) else tensors)
    pairs = [(name, name) for name in given]
    for served_name, trainer_name in (tied or {}).items():
        if served_name in served and served_name not in given and trainer_name in given:
            pairs.append((served_name, trainer_name))
    checked, mismatched, missing = [], [], []
    for served_name, trainer_name in pairs:
        mine = served.get(served_name)
        if mine is None:
            missing.append(served_name)
            continue
        checked.append(served_name)
        if tensor_checksum(given[trainer_name], mine.dtype, mine.added) != mine:
            mismatched.append(served_name)
    return WeightVerification(tuple(checked), tuple(mismatched), tuple(missing))
