"""Starting without weights (``EngineConfig(load_format="dummy")``, verl's ``load_format: dummy``):
the colocated-RL norm, where the trainer holds the policy and the engine should not read a
checkpoint at start. The engine starts on random weights of the right shapes, refuses to
generate (``WeightsNotLoaded``) and refuses partial updates until a full update has loaded; from
then on it serves exactly that policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.report import KitReport
from rlinfer_conformance.world import BASE, OTHER, KitWorld, own_world
from rlinfer_core.errors import WeightsNotLoaded, WeightUpdateError
from rlinfer_core.types import GenerateRequest
from rlinfer_core.weights import NamedTensors

__all__ = ["rlinfer_dummy_world", "test_dummy_start_serves_only_after_a_full_update"]


@pytest.fixture(scope="module")
def rlinfer_dummy_world(
    rlinfer_backend: str,
    rlinfer_config_overrides: dict[str, Any],
    rlinfer_report: KitReport,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[KitWorld]:
    """An engine of its own started with ``load_format="dummy"`` on the kit's tiny model."""
    overrides = {**rlinfer_config_overrides, "load_format": "dummy"}
    tmp = Path(tmp_path_factory.mktemp("rlinfer-kit-dummy"))
    with own_world(rlinfer_backend, overrides, rlinfer_report, tmp, "llama", "dummy", "load_format='dummy'") as world:
        yield world


@pytest.mark.hooks("rlinfer_generate", "rlinfer_update_weights")
def test_dummy_start_serves_only_after_a_full_update(rlinfer_dummy_world: KitWorld) -> None:
    world = rlinfer_dummy_world
    engine = world.engine
    transports = world.local_transports()
    assert transports, "the backend claims no local weight transport (tensors, buckets or disk)"
    assert engine.weights_discarded, "a dummy start holds no policy"
    request = GenerateRequest(prompt_token_ids=[1, 2])
    with pytest.raises(WeightsNotLoaded):
        engine.generate([request])
    with pytest.raises(WeightsNotLoaded):
        list(engine.stream(request))
    with pytest.raises(WeightUpdateError, match="full update"):
        engine.update_weights(NamedTensors.of(world.oracle.named_parameters(BASE)[:2]))
    version = engine.weight_version
    world.update(transports[0], BASE)  # the first sync: full, verified by readback where claimed
    assert engine.weight_version == version + 1 and not engine.weights_discarded
    world.generate_and_check("after_dummy_start")
    world.update(transports[-1], OTHER)  # later updates as on any engine
    world.generate_and_check("after_dummy_start_second_update")
