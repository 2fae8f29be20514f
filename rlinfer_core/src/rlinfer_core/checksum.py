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
- ``fp:`` (tensors on a GPU): computed on a GPU with integer torch ops, so checking a 1.26 GB
  model costs a few passes over GPU memory instead of a copy to the host and a byte hash. A GPU
  tensor is fingerprinted where it lives; a host tensor (a trainer's CPU copy, a checkpoint read
  back) on this process's GPU when it has one, in pieces of :data:`_GROUP_ROWS` rows.
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


#: the two moduli (primes) and column multipliers of the fingerprint
_MODULI = ((2**31 - 1, 1), (2**31 - 19, 40503))
#: column weights are ``(column * multiplier) % _PERIOD + 1``: every word x weight is below 2^47
_PERIOD = 65521
#: words per row: a row's 2^12 products stay below 2^59 in int64
_ROW = 1 << 12
#: rows per pass: 8M words, 64 MiB of int64 (twice that for the products)
_GROUP_ROWS = 1 << 11
_CONSTANTS: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Column weights ``[2, 1, _ROW]``, moduli ``[2, 1]`` and a row of zero words, made once."""
    import torch

    key = str(device)
    if key not in _CONSTANTS:
        column = torch.arange(_ROW, dtype=torch.int64, device=device)
        weights = torch.stack([(column * m) % _PERIOD + 1 for _, m in _MODULI]).unsqueeze(1)
        moduli = torch.tensor([[p] for p, _ in _MODULI], dtype=torch.int64, device=device)
        _CONSTANTS[key] = (weights, moduli, torch.zeros(_ROW, dtype=torch.int32, device=device))
    return _CONSTANTS[key]


def _words(data: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat run of the widest integer words that divide their size."""
    import torch

    raw = data.reshape(-1).view(torch.uint8)
    if raw.numel() % 4 == 0:
        return raw.view(torch.int32)
    if raw.numel() % 2 == 0:
        return raw.view(torch.int16)
    return raw


def _fingerprint_device(words: torch.Tensor) -> torch.device:
    """Where ``words`` are fingerprinted: a GPU tensor where it lives, a host tensor on this
    process's GPU when it has one (the same sums, ~20x faster than on the host)."""
    import torch

    if words.device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return words.device


def _fingerprints(runs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Fingerprint sums ``[2, len(runs)]`` (int64) of word runs, computed on ``device`` in passes
    over many tensors at once (rows never straddle two tensors; each pass copies its rows there
    from a run on another device); nothing waits for the device.

    Row ``r`` of a run (``_ROW`` words, the last one zero-padded) sums ``word x column weight``;
    the run's sum is ``sum_r (row sum mod p) x (r + 1) mod p`` for each modulus ``p``.
    """
    import torch

    weights, moduli, zeros = _constants(device)
    chunks: list[tuple[int, int, int]] = []  # (run, first row, rows)
    for index, run in enumerate(runs):
        rows = -(-run.numel() // _ROW)
        chunks.extend((index, first, min(_GROUP_ROWS, rows - first)) for first in range(0, rows, _GROUP_ROWS))
    out = torch.zeros(2, len(runs), dtype=torch.int64, device=device)
    group: list[tuple[int, int, int]] = []
    filled = 0
    for chunk in [*chunks, None]:
        if chunk is not None and filled + chunk[2] <= _GROUP_ROWS:
            group.append(chunk)
            filled += chunk[2]
            continue
        if group:
            parts: list[torch.Tensor] = []
            owners: list[int] = []
            positions: list[int] = []
            for index, first, rows in group:
                words = runs[index][first * _ROW : (first + rows) * _ROW].to(device=device, dtype=torch.int32)
                parts.append(words)
                if words.numel() < rows * _ROW:
                    parts.append(zeros[: rows * _ROW - words.numel()])
                owners.extend([index] * rows)
                positions.extend(range(first + 1, first + rows + 1))
            block = torch.cat(parts).to(torch.int64).view(1, -1, _ROW)
            row_sums = (block * weights).sum(dim=2) % moduli
            scale = torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True)
            owner = torch.tensor(owners, dtype=torch.int64).to(device, non_blocking=True)
            out.index_add_(1, owner, (row_sums * scale) % moduli)
            out %= moduli
        group, filled = ([chunk], chunk[2]) if chunk is not None else ([], 0)
    return out


def _blake2b(data: torch.Tensor) -> str:
    import torch

    raw = data.cpu().reshape(-1).view(torch.uint8) if data.numel() else data.cpu().reshape(-1)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()


#: one tensor to check: (tensor, dtype or None for its own, added, algorithm or None for its device's)
ChecksumItem = tuple["torch.Tensor", str | None, float, str | None]


def tensor_checksums(items: Sequence[ChecksumItem]) -> list[WeightChecksum]:
    """:func:`tensor_checksum` of many tensors; GPU fingerprints in passes over many tensors at
    once, read back in one transfer per device."""
    import torch

    bodies: list[str] = []
    metas: list[tuple[str, str, tuple[int, ...], float]] = []
    runs: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}  # fingerprinted on -> (item, words)
    with torch.no_grad():
        for position, (tensor, dtype, added, algorithm) in enumerate(items):
            target = getattr(torch, dtype) if dtype else tensor.dtype
            kind = algorithm or ("fp" if tensor.device.type == "cuda" else "b2")
            data = tensor.detach().to(dtype=target)
            if added:
                data = data + added
            data = data.contiguous()
            metas.append((kind, str(target).removeprefix("torch."), tuple(tensor.shape), added))
            if kind == "fp" and data.numel():
                words = _words(data)
                runs.setdefault(_fingerprint_device(words), []).append((position, words))
                bodies.append(f"{words.numel():x}")
            else:
                bodies.append(_blake2b(data))
        for device, found in runs.items():
            sums = _fingerprints([words for _, words in found], device).t().tolist()
            for (position, _), (first, second) in zip(found, sums, strict=True):
                bodies[position] = f"{first:08x}{second:08x}{bodies[position]}"
    return [
        WeightChecksum(dtype_name, shape, f"{kind}:{body}", added)
        for (kind, dtype_name, shape, added), body in zip(metas, bodies, strict=True)
    ]


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
