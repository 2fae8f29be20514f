"""Start, capabilities, model info, weight specs, health, events, shutdown."""

from __future__ import annotations

import pytest
from rlinfer_core.errors import EngineDead
from rlinfer_core.types import Capability, GenerateRequest, SamplingParams

from rlinfer_conformance.world import BASE, KitWorld

__all__ = [
    "test_capabilities_are_honest_and_stable",
    "test_model_info_matches_checkpoint",
    "test_weight_specs_match_hf_checkpoint",
    "test_check_health",
    "test_start_event_fired",
    "test_shutdown_is_final_and_idempotent",
]


@pytest.mark.hooks("rlinfer_capabilities", "rlinfer_start")
def test_capabilities_are_honest_and_stable(rlinfer_world: KitWorld) -> None:
    from rlinfer_core.discovery import get_backend

    caps = rlinfer_world.engine.capabilities
    assert caps.backend == rlinfer_world.backend
    assert caps.platform in ("cpu", "cuda")
    assert caps.engine_version
    assert caps.supported <= set(Capability)
    described = get_backend(rlinfer_world.backend).describe()
    assert described.supported == caps.supported, (
        "BackendInfo.describe() must predict the running engine's capabilities: "
        f"{sorted(described.supported ^ caps.supported)} differ"
    )
    for cap in set(Capability) - caps.supported:
        assert caps.notes.get(cap.value), f"unsupported {cap.value} needs a note saying why"


@pytest.mark.hooks("rlinfer_model_info")
def test_model_info_matches_checkpoint(rlinfer_world: KitWorld) -> None:
    info = rlinfer_world.engine.model_info
    assert info is not None
    tok = rlinfer_world.oracle.tokenizer
    assert info.vocab_size == 384
    assert tok.eos_token_id in info.eos_token_ids
    assert info.max_model_len == rlinfer_world.engine.async_engine.config.max_model_len


@pytest.mark.hooks("rlinfer_weight_specs")
def test_weight_specs_match_hf_checkpoint(rlinfer_world: KitWorld) -> None:
    specs = rlinfer_world.engine.weight_specs
    hf = dict(rlinfer_world.oracle.named_parameters(BASE))
    assert set(specs) == set(hf), f"names differ: engine-only {set(specs) - set(hf)}, HF-only {set(hf) - set(specs)}"
    for name, spec in specs.items():
        assert spec.name == name
        assert tuple(spec.shape) == tuple(hf[name].shape), name
        served = rlinfer_world.engine.async_engine.config.dtype
        assert spec.dtype == served, f"{name}: {spec.dtype} (the kit runs the engine in {served})"


@pytest.mark.hooks("rlinfer_check_health")
def test_check_health(rlinfer_world: KitWorld) -> None:
    rlinfer_world.engine.check_health()
    rlinfer_world.engine.check_health()


@pytest.mark.hooks("rlinfer_on_engine_started", "rlinfer_on_generate_done")
def test_start_event_fired(rlinfer_world: KitWorld) -> None:
    names = rlinfer_world.events.names()
    assert names.count("rlinfer_on_engine_started") == 1
    seen = len(rlinfer_world.events.events)
    rlinfer_world.generate([GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2))])
    assert "rlinfer_on_generate_done" in rlinfer_world.events.names()[seen:]


@pytest.mark.rlinfer_last
@pytest.mark.hooks("rlinfer_shutdown", "rlinfer_on_engine_shutdown")
def test_shutdown_is_final_and_idempotent(rlinfer_world: KitWorld) -> None:
    engine = rlinfer_world.engine
    async_engine = engine.async_engine
    engine.shutdown()
    assert rlinfer_world.events.names().count("rlinfer_on_engine_shutdown") == 1
    engine.shutdown()  # safe twice
    import asyncio

    with pytest.raises(EngineDead):
        asyncio.run(async_engine.generate([GenerateRequest(prompt_token_ids=[1])]))
