"""Oracle extensions for the agent-rollout tests (issue 13): LoRA adapters merged into a copy of
an oracle model, PEFT adapter directories for the tiny model, and raw teacher-forced logprobs."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlinfer_conformance.oracle import Oracle

#: the modules the kit's adapter changes (attention q and v projections of every layer)
LORA_TARGETS = ("q_proj", "v_proj")


def make_lora_tensors(oracle: Oracle, key: str, rank: int, seed: int, std: float = 0.05) -> dict[str, torch.Tensor]:
    """A random LoRA adapter (PEFT names, float32) for the q/v projections of oracle model ``key``;
    B is non-zero so that the adapter changes the outputs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in oracle._models[key].named_parameters():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in LORA_TARGETS:
            continue
        rows, cols = param.shape
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, cols, generator=generator) * std
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * std
    return out


def peft_config(rank: int, alpha: float) -> dict[str, Any]:
    """The adapter_config.json of :func:`make_lora_tensors` adapters."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(LORA_TARGETS),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }


def save_peft_dir(path: Path, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> Path:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(peft_config(rank, alpha), indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


def add_merged_lora(
    oracle: Oracle, key: str, base: str, tensors: dict[str, torch.Tensor], rank: int, alpha: float
) -> None:
    """Register under ``key`` a copy of oracle model ``base`` with the adapter merged:
    ``W + (alpha / rank) * B @ A`` on every adapted module."""
    import torch

    model = copy.deepcopy(oracle._models[base])
    params = dict(model.named_parameters())
    scale = alpha / rank
    with torch.no_grad():
        for name, a in tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            params[f"{module}.weight"].add_(scale * (b.double() @ a.double()).float())
    oracle._models[key] = model
    oracle._dirs[key] = oracle._dirs[base]


def raw_logprobs(oracle: Oracle, key: str, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """log_softmax of model ``key``'s logits at each of ``tokens`` after ``prompt`` (teacher forcing)."""
    import torch

    logits = oracle.logits(key, list(prompt) + list(tokens))[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(tokens)]
