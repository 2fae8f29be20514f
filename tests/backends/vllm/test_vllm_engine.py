"""vLLM-specific behaviour on the shared Qwen2 engine (``tests/backends/vllm/conftest.py``): what
the shared kit does not cover.

Partial updates of fused parameters, rollback of a load that fails inside vLLM, the two bench
hooks, CPU memory-release refusal, and a clean shutdown (moved after every other test of the
engine by the ``ends_shared_engine`` marker). Each test leaves seed 0's weights served.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_test_helpers import PROMPTS, hf_greedy, state_dict

from rlinfer_core.engine import Engine
from rlinfer_core.errors import EngineDead, UnsupportedCapability, WeightUpdateError
from rlinfer_core.types import Capability, GenerateRequest, MemoryTag, SamplingParams
from rlinfer_core.weights import CheckpointDir, NamedTensors, WeightUpdate

MAX_TOKENS = 8


@pytest.fixture
def models(qwen2_models: tuple[Path, Path]) -> tuple[Path, Path]:
    return qwen2_models


@pytest.fixture
def engine(qwen2_engine: Engine) -> Engine:
    return qwen2_engine


def greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=params) for p in PROMPTS])
    return [list(c.token_ids) for c in out]


def backend_of(engine: Engine) -> Any:
    return engine.async_engine._backend


def test_engine_runs_in_child_processes(engine: Engine) -> None:
    import psutil

    pids = backend_of(engine).transport.engine_processes()
    names = {psutil.Process(pid).name() for pid in pids}
    assert any("EngineCore" in name for name in names), names


def test_greedy_matches_hf(engine: Engine, models: tuple[Path, Path]) -> None:
    assert greedy(engine) == hf_greedy(models[0], state_dict(models[0]), PROMPTS, MAX_TOKENS)


def test_memory_release_is_refused_on_cpu(engine: Engine) -> None:
    assert not engine.capabilities.supports(Capability.MEMORY_RELEASE)
    with pytest.raises(UnsupportedCapability, match="frees no memory"):
        engine.release_memory([MemoryTag.WEIGHTS])
    # the hook itself refuses too, not only the facade
    with pytest.raises(UnsupportedCapability):
        engine._run(backend_of(engine).rlinfer_release_memory(tags=frozenset({MemoryTag.KV_CACHE})))
    with pytest.raises(UnsupportedCapability):
        engine._run(backend_of(engine).rlinfer_resume_memory(tags=frozenset({MemoryTag.KV_CACHE})))
    assert engine.released == frozenset()
    assert len(greedy(engine)) == len(PROMPTS)


def test_partial_update_of_one_fused_part(engine: Engine, models: tuple[Path, Path]) -> None:
    """q_proj alone is a third of vLLM's fused qkv_proj: k and v must keep their values."""
    base, other = state_dict(models[0]), state_dict(models[1])
    name = "model.layers.0.self_attn.q_proj.weight"
    version = engine.update_weights({name: other[name]})
    mixed = {**base, name: other[name]}
    assert greedy(engine) == hf_greedy(models[0], mixed, PROMPTS, MAX_TOKENS)
    assert engine.update_weights(CheckpointDir(str(models[0]))) == version + 1
    assert greedy(engine) == hf_greedy(models[0], base, PROMPTS, MAX_TOKENS)


def test_update_hook_is_all_or_nothing_without_the_facade(engine: Engine, models: tuple[Path, Path]) -> None:
    """Bypass the facade's validation: the worker checks the update itself before vLLM loads any of it."""
    import torch

    before = greedy(engine)
    version = engine.weight_version
    other = state_dict(models[1])
    bad = {**other, "model.layers.1.mlp.down_proj.weight": torch.zeros(3, 3)}
    update = WeightUpdate(NamedTensors.of(bad))
    with pytest.raises(WeightUpdateError, match="down_proj"):
        engine._run(backend_of(engine).rlinfer_update_weights(update=update))
    engine.reset_prefix_cache()
    engine.check_health()
    assert engine.weight_version == version
    assert greedy(engine) == before


def test_update_leaves_the_prefix_cache_to_the_salt(engine: Engine, models: tuple[Path, Path]) -> None:
    """A weight update resets nothing in vLLM: the prefix a request computed before it stays
    cached under that version's salt, which no later request carries (rlinfer_vllm.versions);
    the new version's salt finds none of it, and the explicit reset still drops it. Observed by
    probes straight into AsyncLLM (``num_cached_tokens`` of a one-token request)."""
    import uuid

    from vllm import SamplingParams as EngineSampling

    from rlinfer_vllm.versions import cache_salt

    transport = backend_of(engine).transport
    prompt = [3 + (7 * i) % 200 for i in range(300)]  # several KV blocks

    def cached_under(version: int) -> int:
        async def probe() -> int:
            salted = {"prompt_token_ids": prompt, "cache_salt": cache_salt(transport._versions.nonce, version)}
            last = None
            async for out in transport._llm.generate(salted, EngineSampling(max_tokens=1), f"probe-{uuid.uuid4()}"):
                last = out
            assert last is not None
            return int(last.num_cached_tokens or 0)

        return engine._run(probe())

    engine.generate(GenerateRequest(prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=1)))
    old = engine.weight_version
    assert cached_under(old) > 0, "rlinfer's request did not carry its version's salt"
    new = engine.update_weights(NamedTensors.of(state_dict(models[1])))
    assert cached_under(old) > 0, "the update reset vLLM's prefix cache"
    assert cached_under(new) == 0, "a request of the new version found a prefix of the old weights"
    engine.reset_prefix_cache()
    assert cached_under(old) == 0, "the explicit reset_prefix_cache left the prefix cached"
    engine.update_weights(NamedTensors.of(state_dict(models[0])))
    assert greedy(engine) == hf_greedy(models[0], state_dict(models[0]), PROMPTS, MAX_TOKENS)


def test_loads_under_a_running_request_run_at_the_engine_cores_step_boundary(
    engine: Engine, models: tuple[Path, Path]
) -> None:
    """With a request running, a load is one call into rlinfer's engine-core utility, which runs
    it between two engine steps (rlinfer_vllm.engine_core.step_boundary), not a pause, load and
    resume from here: a load the worker rejects switches no version and leaves the old weights
    serving, and an accepted one switches the stream's versions once, at a token boundary."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch

    transport = backend_of(engine).transport
    assert transport.loads_at_step_boundary, "rlinfer's engine-core plugin did not answer"
    through_boundary: list[str] = []
    original = transport.rpc_at_step_boundary

    async def counted(method: str, *args: Any, version: int) -> Any:
        through_boundary.append(method)
        return await original(method, *args, version=version)

    base, other = state_dict(models[0]), state_dict(models[1])
    bad = {**other, "model.layers.1.mlp.down_proj.weight": torch.zeros(3, 3)}
    transport.rpc_at_step_boundary = counted
    try:
        for _ in range(3):
            through_boundary.clear()
            sampling = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            request = GenerateRequest(prompt_token_ids=PROMPTS[0], sampling=sampling, request_id=f"long-{_}")
            first = threading.Event()

            def consume(request: GenerateRequest = request, first: threading.Event = first) -> list[Any]:
                deltas = []
                for delta in engine.stream(request):
                    deltas.append(delta)
                    first.set()
                return deltas

            with ThreadPoolExecutor(1) as pool:
                streamed = pool.submit(consume)
                assert first.wait(120), "the request produced no token"
                old = engine.weight_version
                rejected = WeightUpdate(NamedTensors.of(bad), old + 7)  # a version no token may carry
                with pytest.raises(WeightUpdateError, match="down_proj"):
                    engine._run(backend_of(engine).rlinfer_update_weights(update=rejected))
                assert engine.weight_version == old
                spanned = request.request_id in engine.in_flight
                new = engine.update_weights(NamedTensors.of(other))
                spanned = spanned and request.request_id in engine.in_flight
                versions = [v for delta in streamed.result(timeout=300) for v in (delta.token_versions or ())]
            engine.update_weights(NamedTensors.of(base))
            if spanned:  # premise: the request ran through both loads
                break
        else:
            pytest.fail("premise not reached in 3 tries: the request finished before the loads")
        assert through_boundary == ["rlinfer_load_ipc", "rlinfer_load_ipc"], through_boundary
        switch = versions.index(new)
        assert set(versions[:switch]) == {old} and set(versions[switch:]) == {new}, versions
    finally:
        del transport.rpc_at_step_boundary
    assert greedy(engine) == hf_greedy(models[0], base, PROMPTS, MAX_TOKENS)


def test_bench_hooks(engine: Engine, models: tuple[Path, Path]) -> None:
    base, other = state_dict(models[0]), state_dict(models[1])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    batch = [GenerateRequest(prompt_token_ids=p, sampling=params) for p in PROMPTS]
    assert engine.bench_raw_generate(batch) == len(PROMPTS) * 2 * MAX_TOKENS

    started = time.perf_counter()
    engine.bench_raw_weight_update(str(models[1]))
    assert time.perf_counter() - started < 30
    assert greedy(engine) == hf_greedy(models[1], other, PROMPTS, MAX_TOKENS)
    # a partial update after vLLM's own reload merges into the weights now served (seed 1)
    name = "model.layers.1.self_attn.v_proj.weight"
    engine.update_weights({name: base[name]})
    assert greedy(engine) == hf_greedy(models[1], {**other, name: base[name]}, PROMPTS, MAX_TOKENS)
    engine.update_weights(NamedTensors.of(base))
    assert greedy(engine) == hf_greedy(models[0], base, PROMPTS, MAX_TOKENS)


@pytest.mark.ends_shared_engine
def test_shutdown_leaves_no_child_processes(engine: Engine) -> None:
    import psutil

    backend = backend_of(engine)
    pids = backend.transport.engine_processes()
    assert pids
    engine.shutdown()
    assert backend.transport.engine_processes() == []
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    with pytest.raises(EngineDead):
        engine.async_engine._backend._alive()
