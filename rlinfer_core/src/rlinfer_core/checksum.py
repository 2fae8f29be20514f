"""Integrity readback: checksums of the weights an engine really serves.

A backend that claims ``weights.checksum`` computes :func:`tensor_checksum` inside the engine,
over its own parameters mapped back to Hugging Face names (a fused ``qkv_proj`` sliced back into
``q_proj``/``k_proj``/``v_proj``; the output head reported as ``lm_head.weight`` even when it is
tied to the embedding). :meth:`rlinfer_core.engine.AsyncEngine.verify_weights` computes the same
checksum over the trainer's tensors, cast to the dtype the engine holds, and compares. This
catches an update that silently missed a parameter without any reference model.

Two digest algorithms, named by the digest's prefix; the trainer's side is computed with the one
the engine used, so either side's tensor may live on either device:

- ``b2:`` (tensors on the host): blake2b-128 of the bytes.
- ``fp:`` (tensors on a GPU): computed where the tensor lives with integer torch ops, so checking a
  1.26 GB model costs a few passes over GPU memory instead of a copy to the host and a byte hash.
  Two position-weighted sums of the bytes read as 32-bit words (16- or 8-bit where the size needs
  it), one modulo ``2^31 - 1`` and one modulo ``2^31 - 19`` with different weights: a change of one
  word always changes it (the difference would have to be a multiple of both primes, larger than
  any word), other changes collide with odds of about 2^-62. A fingerprint against loader faults,
  not a cryptographic hash; on a CPU it is ~20x slower than blake2b, hence the two.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
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
    digest: str  #: fingerprint of the tensor's bytes, row-major, in ``dtype`` (module docstring)
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


#: the two moduli (primes) and position multipliers of the fingerprint
_MODULI = ((2**31 - 1, 1), (2**31 - 19, 40503))
#: positions within a slab cycle with this period (keeps every word x weight below 2^47)
_PERIOD = 65521
#: words summed in int64 before reducing (2^15 products below 2^47 stay below 2^62)
_ROW = 1 << 15
#: words per pass (a multiple of _ROW): bounds the int64 temporaries (32 MiB); slab k's sum is
#: weighted by k + 1
_SLAB = 1 << 22
_WEIGHTS: dict[str, torch.Tensor] = {}


def _weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position weights ``[2, _SLAB]`` and the moduli ``[2, 1]`` on ``device`` (made once)."""
    import torch

    key = str(device)
    if key not in _WEIGHTS:
        index = torch.arange(_SLAB, dtype=torch.int64, device=device)
        _WEIGHTS[key] = torch.stack([(index * m) % _PERIOD + 1 for _, m in _MODULI])
        _WEIGHTS[f"{key}/moduli"] = torch.tensor([[p] for p, _ in _MODULI], dtype=torch.int64, device=device)
    return _WEIGHTS[key], _WEIGHTS[f"{key}/moduli"]


def _words(data: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat run of the widest integer words that divide their size."""
    import torch

    raw = data.reshape(-1).view(torch.uint8)
    if raw.numel() % 4 == 0:
        return raw.view(torch.int32)
    if raw.numel() % 2 == 0:
        return raw.view(torch.int16)
    return raw


def _fingerprint_sums(words: torch.Tensor) -> torch.Tensor:
    """The two sums ``[2]`` (int64, on the words' device; nothing waits for the device)."""
    import torch

    weights, moduli = _weights(words.device)
    total = torch.zeros(2, dtype=torch.int64, device=words.device)
    for k, start in enumerate(range(0, words.numel(), _SLAB)):
        slab = words[start : start + _SLAB].to(torch.int64)
        pad = (-slab.numel()) % _ROW
        if pad:
            slab = torch.cat([slab, slab.new_zeros(pad)])
        rows = (slab.unsqueeze(0) * weights[:, : slab.numel()]).view(2, -1, _ROW).sum(dim=2)
        part = (rows % moduli).sum(dim=1) % moduli[:, 0]
        total = (total + part * (k + 1)) % moduli[:, 0]
    return total


def _blake2b(data: torch.Tensor) -> str:
    import torch

    raw = data.cpu().reshape(-1).view(torch.uint8) if data.numel() else data.cpu().reshape(-1)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()


#: one tensor to check: (tensor, dtype or None for its own, added, algorithm or None for its device's)
ChecksumItem = tuple["torch.Tensor", str | None, float, str | None]


def _read_back(pending: list[torch.Tensor]) -> list[list[int]]:
    """The fingerprint sums, one transfer per device."""
    import torch

    out: list[list[int]] = [[] for _ in pending]
    for device in {str(t.device) for t in pending}:
        indices = [i for i, t in enumerate(pending) if str(t.device) == device]
        for i, row in zip(indices, torch.stack([pending[i] for i in indices]).tolist(), strict=True):
            out[i] = row
    return out


def tensor_checksums(items: Sequence[ChecksumItem]) -> list[WeightChecksum]:
    """:func:`tensor_checksum` of many tensors; GPU fingerprints are read back in one transfer."""
    import torch

    kinds: list[str] = []
    bodies: list[str | None] = []
    pending: list[torch.Tensor] = []
    numels: list[int] = []
    metas: list[tuple[str, tuple[int, ...], float]] = []
    with torch.no_grad():
        for tensor, dtype, added, algorithm in items:
            target = getattr(torch, dtype) if dtype else tensor.dtype
            kind = algorithm or ("fp" if tensor.device.type == "cuda" else "b2")
            data = tensor.detach().to(dtype=target)
            if added:
                data = data + added
            data = data.contiguous()
            metas.append((str(target).removeprefix("torch."), tuple(tensor.shape), added))
            kinds.append(kind)
            if kind == "fp" and data.numel():
                words = _words(data)
                pending.append(_fingerprint_sums(words))
                numels.append(words.numel())
                bodies.append(None)
            else:
                bodies.append(_blake2b(data))
        sums = _read_back(pending)
    out: list[WeightChecksum] = []
    found = iter(zip(sums, numels, strict=True))
    for kind, body, (dtype_name, shape, added) in zip(kinds, bodies, metas, strict=True):
        if body is None:
            (first, second), count = next(found)
            body = f"{first:08x}{second:08x}{count:x}"
        out.append(WeightChecksum(dtype_name, shape, f"{kind}:{body}", added))
    return out


def tensor_checksum(
    tensor: torch.Tensor, dtype: str | None = None, added: float = 0.0, algorithm: str | None = None
) -> WeightChecksum:
    """Checksum of ``tensor`` cast to ``dtype`` (default: its own dtype), plus ``added`` (see
    :attr:`WeightChecksum.added`; the engine reports its served tensor with ``added=0``).
    ``algorithm``: ``"b2"`` or ``"fp"`` (module docstring); default by the tensor's device."""
    return tensor_checksums([(tensor, dtype, added, algorithm)])[0]


def digest_algorithm(checksum: WeightChecksum) -> str:
    """The algorithm a checksum's digest was computed with (``b2`` for unprefixed ones)."""
    kind, sep, _ = checksum.digest.partition(":")
    return kind if sep else "b2"


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
    compared: list[tuple[str, WeightChecksum]] = []
    items: list[ChecksumItem] = []
    for served_name, trainer_name in pairs:
        mine = served.get(served_name)
        if mine is None:
            missing.append(served_name)
            continue
        checked.append(served_name)
        compared.append((served_name, mine))
        items.append((given[trainer_name], mine.dtype, mine.added, digest_algorithm(mine)))
    for (served_name, mine), theirs in zip(compared, tensor_checksums(items), strict=True):
        if theirs != mine:
            mismatched.append(served_name)
    return WeightVerification(tuple(checked), tuple(mismatched), tuple(missing))
