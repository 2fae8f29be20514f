"""Start, capabilities, model info, weight specs, health, events, shutdown."""

from __future__ import annotations

import time

import pytest

from rlinfer_conformance.world import BASE, OP_TIMEOUT_S, KitWorld
from rlinfer_core.errors import EngineDead
from rlinfer_core.types import Capability, GenerateRequest, SamplingParams

#: a healthy engine answers check_health within this (the facade gives up at 30 s)
HEALTH_CHECK_BOUND_S = 10.0

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
    from rlinfer_core.agent import derive_capabilities
    from rlinfer_core.discovery import get_backend

    caps = rlinfer_world.engine.capabilities
    assert caps.backend == rlinfer_world.backend
    assert caps.platform in ("cpu", "cuda")
    assert caps.engine_version
    assert caps.supported <= set(Capability)
    described = derive_capabilities(get_backend(rlinfer_world.backend).describe())  # as the facade does
    assert derive_capabilities(get_backend(rlinfer_world.backend).describe()) == described, "describe() is stable"
    # describe() tells what the platform can do; a running engine may claim less where its config
    # turns a capability off (e.g. memory release without enable_memory_release), never more
    extra = caps.supported - described.supported
    assert not extra, f"the running engine claims {sorted(extra)}, which BackendInfo.describe() does not predict"
    for cap in described.supported - caps.supported:
        assert caps.notes.get(cap.value), f"{cap.value} is off in this engine's config; its note must say why"
    for cap in set(Capability) - caps.supported:
        assert caps.notes.get(cap.value), f"unsupported {cap.value} needs a note saying why"


@pytest.mark.hooks("rlinfer_model_info")
def test_model_info_matches_checkpoint(rlinfer_world: KitWorld) -> None:
    info = rlinfer_world.engine.model_info
    assert info is not None
    tok = rlinfer_world.oracle.tokenizer
    assert info.vocab_size == 384
    assert tok.eos_token_id in info.eos_token_ids
    assert info.max_model_len == rlinfer_world.engine.config.max_model_len


@pytest.mark.hooks("rlinfer_weight_specs")
def test_weight_specs_match_hf_checkpoint(rlinfer_world: KitWorld) -> None:
    specs = rlinfer_world.engine.weight_specs
    hf = dict(rlinfer_world.oracle.named_parameters(BASE))
    assert set(specs) == set(hf), f"names differ: engine-only {set(specs) - set(hf)}, HF-only {set(hf) - set(specs)}"
    for name, spec in specs.items():
        assert spec.name == name
        assert tuple(spec.shape) == tuple(hf[name].shape), name
        served = rlinfer_world.engine.config.dtype
        assert spec.dtype == served, f"{name}: {spec.dtype} (the kit runs the engine in {served})"


@pytest.mark.hooks("rlinfer_check_health")
def test_check_health(rlinfer_world: KitWorld) -> None:
    engine = rlinfer_world.engine
    version = engine.weight_version
    requests = rlinfer_world.greedy_requests(max_tokens=24)
    running = rlinfer_world.submit(rlinfer_world.generate, requests)
    for _ in range(2):  # answers while serving, and again
        started = time.perf_counter()
        engine.check_health()  # raises EngineDead (or EngineTimeout) otherwise
        assert time.perf_counter() - started < HEALTH_CHECK_BOUND_S, "a health check must answer promptly"
    rlinfer_world.check_parity(None, requests, running.result(timeout=OP_TIMEOUT_S))  # undisturbed
    assert engine.weight_version == version, "a health check changes no state"
    assert engine.in_flight == frozenset()


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
    engine.shutdown()
    assert rlinfer_world.events.names().count("rlinfer_on_engine_shutdown") == 1
    engine.shutdown()  # safe twice
    with pytest.raises(EngineDead):
        engine.check_health()
    with pytest.raises(EngineDead):
        engine.generate([GenerateRequest(prompt_token_ids=[1])])
    with pytest.raises(EngineDead):  # a plain call reaches the engine itself: it is shut down too
        engine.session()
