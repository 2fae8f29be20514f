"""Safetensors checkpoint directories (the disk transport)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.weights import TensorSpec

if TYPE_CHECKING:
    import torch

DEFAULT_SHARD_BYTES = 2 << 30

#: safetensors header dtype -> torch dtype name
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def save_dir(
    tensors: Iterable[tuple[str, torch.Tensor]], path: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> Path:
    """Write tensors as ``model-0000i-of-0000n.safetensors`` shards plus an HF index file."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    storages: set[int] = set()
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        data = tensor.detach().contiguous().cpu()
        storage = data.untyped_storage().data_ptr()
        if storage in storages:  # safetensors refuses tensors sharing memory (views of one tensor)
            data = data.clone()
        storages.add(storage)
        shards[-1][name] = data
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out


def _files(path: str | Path) -> list[Path]:
    root = Path(path)
    if not root.is_dir():
        raise WeightUpdateError(f"checkpoint directory {str(root)!r} does not exist")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"checkpoint directory {str(root)!r} holds no *.safetensors files")
    return files


def read_specs(path: str | Path) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    specs = {}
    for file in _files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    sl = f.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower())
                    specs[name] = TensorSpec(name, dtype, tuple(sl.get_shape()))
        except Exception as exc:
            raise WeightUpdateError(f"unreadable safetensors file {file.name}: {exc}") from exc
    return specs


def read_tensors(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the directory (memory-mapped by safetensors)."""
    from safetensors import safe_open

    out = []
    for file in _files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    out.append((name, f.get_tensor(name)))
        except Exception as exc:
            raise WeightUpdateError(f"unreadable safetensors file {file.name}: {exc}") from exc
    return out


#: free device memory kept beyond the checkpoint's size before it is staged on the device
STAGING_HEADROOM_BYTES = 512 << 20


def read_checked(path: str | Path, device: str | torch.device = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the directory, checked finite before the caller loads any of it
    (WeightUpdateError naming the offenders otherwise).

    On a CUDA ``device`` with room for the whole checkpoint the tensors are copied there first:
    the copy is the one the load would make anyway, and the check then takes a fraction of a
    millisecond instead of a pass over host memory. Otherwise they stay on the host.
    """
    import torch

    from rlinfer_core.transfer.validate import nonfinite_problems

    tensors = read_tensors(path)
    target = torch.device(device)
    if target.type == "cuda":
        need = sum(t.numel() * t.element_size() for _, t in tensors)
        free, _total = torch.cuda.mem_get_info(target)
        if free > need + STAGING_HEADROOM_BYTES:
            tensors = [(name, t.to(target, non_blocking=True)) for name, t in tensors]
    problems = nonfinite_problems(tensors)
    if problems:
        raise WeightUpdateError(f"checkpoint {str(path)!r} rejected", tuple(problems))
    return tensors
