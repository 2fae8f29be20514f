"""Delta weight sync (``weights.delta``): only changed tensors, applied to the right base version.

The delta replaces a few tensors of the base model, among them halves of the engines' fused
layouts (q of qkv, gate of gate_up), by the second model's; an oracle model built from the same
mix checks what the engine then serves.
"""

from __future__ import annotations

import shutil

import pytest

from rlinfer_conformance.world import BASE, OTHER, KitWorld
from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.types import Capability
from rlinfer_core.weights import WeightDelta

__all__ = ["test_delta_applies_to_its_base_version", "test_delta_for_another_base_version_is_rejected"]

MIXED = "delta-mixed"
#: the tensors the delta takes from the second model (partial fused layers on purpose)
CHANGED = ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight", "lm_head.weight")


def _mixed_oracle(world: KitWorld) -> None:
    """Register oracle model MIXED: the base model with CHANGED taken from the second one."""
    try:
        world.oracle.model_dir(MIXED)
        return
    except KeyError:
        pass
    from rlinfer_core.transfer.disk import read_tensors, save_dir

    other = dict(read_tensors(world.oracle.model_dir(OTHER)))
    mixed = [(n, other[n] if n in CHANGED else t) for n, t in read_tensors(world.oracle.model_dir(BASE))]
    path = world.tmp / MIXED
    shutil.copytree(world.oracle.model_dir(BASE), path, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_dir(mixed, path)
    world.oracle.add(MIXED, path)


@pytest.mark.requires(Capability.WEIGHTS_DELTA)
def test_delta_applies_to_its_base_version(rlinfer_base_weights: KitWorld) -> None:
    from rlinfer_core.delta import changed_tensors

    world = rlinfer_base_weights
    _mixed_oracle(world)
    present = {n for n, _ in world.oracle.named_parameters(MIXED)}
    delta = changed_tensors(world.oracle.named_parameters(BASE), world.oracle.named_parameters(MIXED))
    assert sorted(n for n, _ in delta) == sorted(n for n in CHANGED if n in present), "the delta finds the mix"
    world.generate_and_check(None)  # base-weight KV in the prefix cache
    base = world.engine.weight_version
    seen = len(world.events.events)
    assert world.engine.update_weights(WeightDelta(base, delta)) == base + 1 == world.engine.weight_version
    world.current = MIXED
    updated = [e for n, e in world.events.events[seen:] if n == "rlinfer_on_weights_updated"]
    assert updated == [{"version": base + 1, "transport": "delta"}]
    world.verify_served(MIXED, "after a delta update")
    world.generate_and_check(f"after_delta_v{base + 1}")


@pytest.mark.requires(Capability.WEIGHTS_DELTA)
def test_delta_for_another_base_version_is_rejected(rlinfer_base_weights: KitWorld) -> None:
    world = rlinfer_base_weights
    version = world.engine.weight_version
    tensors = [(n, t) for n, t in world.oracle.named_parameters(OTHER) if n in CHANGED]
    for base in (version + 1, max(version - 1, 0) if version else version + 2):
        with pytest.raises(WeightUpdateError, match="base_version") as info:
            world.engine.update_weights(WeightDelta(base, tensors))
        assert f"weight_version {version}" in str(info.value)
    assert world.engine.weight_version == version
    world.verify_served(BASE, "after rejected deltas")
    world.generate_and_check("after_rejected_delta")  # still the old weights
