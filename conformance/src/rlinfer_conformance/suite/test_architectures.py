"""Parity and weight updates on more than one architecture.

The whole kit runs on the tiny Llama (untied head, no biases). Weight loaders break on other
layouts - a tied output head, q/k/v biases, per-head q/k norms - so every other architecture of
:data:`rlinfer_core.tiny_model.ARCHITECTURES` gets its own engine and the parity + update subset:
base parity, then an update to the second model and back over every claimed transport, each
checked against the oracle and (with ``weights.checksum``) by integrity readback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.report import KitReport
from rlinfer_conformance.world import BASE, OTHER, KitWorld, own_world
from rlinfer_core.tiny_model import ARCHITECTURES
from rlinfer_core.types import Capability

__all__ = ["rlinfer_arch_world", "test_architecture_parity_and_updates", "test_architecture_planted_fault"]

#: the kit's main engine serves this one
MAIN_ARCHITECTURE = "llama"
EXTRA_ARCHITECTURES = tuple(a for a in ARCHITECTURES if a != MAIN_ARCHITECTURE)

TRANSPORTS = (
    Capability.WEIGHTS_TENSORS,
    Capability.WEIGHTS_BUCKETS,
    Capability.WEIGHTS_DISK,
    Capability.WEIGHTS_BROADCAST,
)


@pytest.fixture(scope="module", params=EXTRA_ARCHITECTURES)
def rlinfer_arch_world(
    request: pytest.FixtureRequest,
    rlinfer_backend: str,
    rlinfer_config_overrides: dict[str, Any],
    rlinfer_report: KitReport,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[KitWorld]:
    """An engine on the tiny model of one more architecture, with its oracle."""
    architecture = str(request.param)
    tmp = Path(tmp_path_factory.mktemp(f"rlinfer-kit-{architecture}"))
    backend, overrides, report = rlinfer_backend, rlinfer_config_overrides, rlinfer_report
    with own_world(backend, overrides, report, tmp, architecture, architecture, architecture) as world:
        yield world


@pytest.mark.hooks("rlinfer_generate", "rlinfer_update_weights")
def test_architecture_parity_and_updates(rlinfer_arch_world: KitWorld) -> None:
    world = rlinfer_arch_world
    arch = world.architecture
    info = world.engine.model_info
    assert info is not None
    tied = world.oracle.tied(BASE)
    if tied and world.supports(Capability.WEIGHTS_CHECKSUM):
        assert dict(info.tied_weights) == tied, f"model_info.tied_weights must name the tie: {info.tied_weights}"
    world.generate_and_check(f"{arch}/start")
    world.verify_served(BASE, f"{arch} at start")
    transports = [t for t in TRANSPORTS if world.supports(t)]
    assert transports, "no weight transport claimed"
    for transport in transports:
        name = transport.value.removeprefix("weights.")
        version = world.update(transport, OTHER)
        world.generate_and_check(f"{arch}/after_update_{name}_v{version}")
        version = world.update(transport, BASE)
        world.generate_and_check(f"{arch}/after_update_back_{name}_v{version}")


def _fault_target(world: KitWorld) -> str:
    """One expert's weight on a mixture of experts, else a norm: what loaders get wrong."""
    names = sorted(world.engine.weight_specs)
    experts = [n for n in names if ".experts." in n]
    return (experts or [n for n in names if "norm" in n])[0]


@pytest.mark.hooks("rlinfer_update_weights", "rlinfer_weights_checksum")
def test_architecture_planted_fault(rlinfer_arch_world: KitWorld) -> None:
    """An update the engine loads wrongly (a fault planted in its own loader) fails typed, the
    version stays, generation is refused until a full update lands, and then parity holds."""
    import json
    import os

    from rlinfer_core.errors import WeightsNotLoaded, WeightUpdateError, WeightVerificationError
    from rlinfer_core.fault_plan import ENV
    from rlinfer_core.types import GenerateRequest, SamplingParams

    world = rlinfer_arch_world
    if not world.engine.verifies_updates:
        pytest.skip("updates are verified only where weights.checksum is claimed")
    target = _fault_target(world)
    plan = os.environ[ENV]
    before = world.engine.weight_version
    with open(plan, "w") as out:
        json.dump({"corrupt": [target]}, out)
    try:
        with pytest.raises(WeightVerificationError) as caught:
            world.engine.update_weights(world.source(Capability.WEIGHTS_TENSORS, OTHER))
    finally:
        os.remove(plan)
    assert target in caught.value.mismatched, caught.value
    assert world.engine.weight_version == before
    request = GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=2))
    with pytest.raises(WeightsNotLoaded):
        world.engine.generate([request])
    base = dict(world.engine.checkpoint_names(world.oracle.named_parameters(BASE)))
    with pytest.raises(WeightUpdateError):  # a partial update cannot repair it
        world.engine.update_weights({target: base[target]})
    world.update(Capability.WEIGHTS_TENSORS, BASE)
    world.generate_and_check(f"{world.architecture}/after_planted_fault")
