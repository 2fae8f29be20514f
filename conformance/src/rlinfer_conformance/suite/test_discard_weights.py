"""``release_memory(discard_weights=True)``: weights dropped without a host backup; after resume
the engine refuses to generate until a full update refills them (GPU engines only in practice)."""

from __future__ import annotations

import pytest

from rlinfer_conformance.world import BASE, OTHER, KitWorld
from rlinfer_core.errors import WeightsNotLoaded, WeightUpdateError
from rlinfer_core.preflight import releasable_memory_tags
from rlinfer_core.types import Capability, GenerateRequest, MemoryTag
from rlinfer_core.weights import NamedTensors, WeightDelta

__all__ = ["test_discarded_weights_refuse_generation_until_a_full_update", "test_phase_switch_with_discarded_weights"]


def _refill(world: KitWorld, key: str) -> None:
    """Resume every tag and load model ``key`` in full (first local transport)."""
    world.engine.resume_memory()
    world.engine.update_weights(world.source(world.local_transports()[0], key))
    world.current = key


@pytest.mark.requires(Capability.MEMORY_DISCARD_WEIGHTS)
def test_discarded_weights_refuse_generation_until_a_full_update(rlinfer_base_weights: KitWorld) -> None:
    world = rlinfer_base_weights
    engine = world.engine
    world.generate_and_check(None)
    version = engine.weight_version
    engine.release_memory(discard_weights=True)
    try:
        assert engine.released == releasable_memory_tags(engine.capabilities) and engine.weights_discarded
        engine.resume_memory()
        request = GenerateRequest(prompt_token_ids=[1, 2])
        with pytest.raises(WeightsNotLoaded):
            engine.generate([request])
        with pytest.raises(WeightsNotLoaded):
            list(engine.stream(request))
        if world.supports(Capability.WEIGHTS_CHECKSUM):
            with pytest.raises(WeightsNotLoaded):
                engine.weights_checksum()
        partial = world.oracle.named_parameters(OTHER)[:2]
        with pytest.raises(WeightUpdateError, match="full update"):
            engine.update_weights(NamedTensors.of(partial))
        if world.supports(Capability.WEIGHTS_DELTA):
            with pytest.raises(WeightUpdateError, match="delta cannot be applied"):
                engine.update_weights(WeightDelta(version, partial))
        assert engine.weight_version == version and engine.weights_discarded
        engine.update_weights(world.source(world.local_transports()[0], OTHER))
        world.current = OTHER
        assert engine.weight_version == version + 1 and not engine.weights_discarded
        world.verify_served(OTHER, "after refilling discarded weights")
        world.generate_and_check("after_discard_refill")
    finally:
        if engine.weights_discarded or engine.released:
            _refill(world, BASE)


@pytest.mark.requires(Capability.MEMORY_DISCARD_WEIGHTS)
def test_phase_switch_with_discarded_weights(rlinfer_base_weights: KitWorld) -> None:
    """release(discard) -> resume(weights) -> update(full) -> resume(kv_cache) -> generate."""
    world = rlinfer_base_weights
    engine = world.engine
    engine.release_memory(discard_weights=True)
    try:
        engine.resume_memory([MemoryTag.WEIGHTS])
        engine.update_weights(world.source(world.local_transports()[0], OTHER))
        world.current = OTHER
        engine.resume_memory()  # the KV cache (and the CUDA graphs, where they were released)
        assert not engine.released and not engine.weights_discarded
        world.generate_and_check("after_discard_phase_switch")
    finally:
        if engine.weights_discarded or engine.released:
            _refill(world, BASE)
