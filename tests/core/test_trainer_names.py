"""Trainer (transformers >= 5) names of mixtures of experts onto checkpoint names."""

from __future__ import annotations

import pytest
import torch

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.trainer_names import expert_groups, name_map, under_checkpoint_names
from rlinfer_core.transfer.buckets import pack, unpack_all
from rlinfer_core.weights import BroadcastSource, Buckets, NamedTensors, TensorSpec

EXPERTS, INTER, HIDDEN = 3, 4, 5


def _checkpoint_names(prefix: str, gate: str, up: str, down: str) -> list[str]:
    names = [f"{prefix}.gate.weight", "model.norm.weight"]
    for e in range(EXPERTS):
        names += [f"{prefix}.experts.{e}.{p}.weight" for p in (gate, up, down)]
    return names


def test_fused_experts_become_views_per_expert() -> None:
    names = name_map(_checkpoint_names("model.layers.0.mlp", "gate_proj", "up_proj", "down_proj"))
    gate_up = torch.arange(EXPERTS * 2 * INTER * HIDDEN, dtype=torch.float32).reshape(EXPERTS, 2 * INTER, HIDDEN)
    down = torch.randn(EXPERTS, HIDDEN, INTER)
    out = dict(
        names.to_checkpoint(
            [("model.layers.0.mlp.experts.gate_up_proj", gate_up), ("model.layers.0.mlp.experts.down_proj", down)]
        )
    )
    assert len(out) == 3 * EXPERTS
    assert torch.equal(out["model.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :INTER])
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, INTER:])
    assert torch.equal(out["model.layers.0.mlp.experts.2.down_proj.weight"], down[2])
    assert out["model.layers.0.mlp.experts.1.up_proj.weight"].data_ptr() == gate_up[1, INTER:].data_ptr()  # a view


def test_mixtral_modules_are_renamed_and_w1_w3_w2_found() -> None:
    checkpoint = _checkpoint_names("model.layers.0.block_sparse_moe", "w1", "w3", "w2")
    [group] = expert_groups(checkpoint)
    assert (group.gate, group.up, group.down, group.count) == ("w1", "w3", "w2", EXPERTS)
    names = name_map(checkpoint)
    router = torch.randn(EXPERTS, HIDDEN)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN)
    out = dict(
        names.to_checkpoint(
            [("model.layers.0.mlp.gate.weight", router), ("model.layers.0.mlp.experts.gate_up_proj", gate_up)]
        )
    )
    assert out["model.layers.0.block_sparse_moe.gate.weight"] is router
    assert torch.equal(out["model.layers.0.block_sparse_moe.experts.0.w3.weight"], gate_up[0, INTER:])


def test_dense_layouts_map_nothing_and_unknown_names_pass_through() -> None:
    names = name_map(["model.layers.0.mlp.gate_proj.weight", "lm_head.weight"])
    assert not names
    pairs = [("nonsense", torch.zeros(1))]
    assert names.to_checkpoint(pairs) == pairs


def test_bucket_manifests_are_mapped_over_the_same_bytes() -> None:
    names = name_map(_checkpoint_names("model.layers.0.mlp", "gate_proj", "up_proj", "down_proj"))
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN)
    down = torch.randn(EXPERTS, HIDDEN, INTER)
    trainer = [("model.layers.0.mlp.experts.gate_up_proj", gate_up), ("model.layers.0.mlp.experts.down_proj", down)]
    source = under_checkpoint_names(Buckets(pack(trainer)), names)
    assert isinstance(source, Buckets)
    mapped = dict(unpack_all(source.buckets))  # the bucket checksum still holds
    expected = dict(names.to_checkpoint(trainer))
    assert mapped.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(mapped[name], tensor), name


def test_named_tensors_mapped_and_a_broadcast_under_trainer_names_refused() -> None:
    names = name_map(_checkpoint_names("model.layers.0.mlp", "gate_proj", "up_proj", "down_proj"))
    down = torch.randn(EXPERTS, HIDDEN, INTER)
    source = under_checkpoint_names(NamedTensors((("model.layers.0.mlp.experts.down_proj", down),)), names)
    assert isinstance(source, NamedTensors)
    assert [n for n, _ in source.tensors] == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    spec = TensorSpec("model.layers.0.mlp.experts.down_proj", "float32", (EXPERTS, HIDDEN, INTER))
    with pytest.raises(WeightUpdateError, match="checkpoint_names"):
        under_checkpoint_names(BroadcastSource((spec,)), names)


def test_vision_language_checkpoints_map_the_nested_in_memory_names() -> None:
    """Qwen2-VL under transformers >= 5: ``model.visual.*`` / ``model.language_model.*`` in memory,
    ``visual.*`` / ``model.*`` in the checkpoint; ``lm_head`` is the same in both."""
    checkpoint = ["visual.blocks.0.attn.qkv.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    names = name_map(checkpoint)
    tensors = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    trainer = list(
        zip(
            [
                "model.visual.blocks.0.attn.qkv.weight",
                "model.language_model.layers.0.self_attn.q_proj.weight",
                "lm_head.weight",
            ],
            tensors,
            strict=True,
        )
    )
    assert [name for name, _ in names.to_checkpoint(trainer)] == checkpoint
    assert not name_map(["model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]), "a text model maps nothing"
