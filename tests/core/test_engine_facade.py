"""The Engine facade around a TEST-ONLY double backend (see recording_double.py).

The double is registered through a throwaway ``rlinfer.backends`` entry point (a dist-info
folder on sys.path), so ``AsyncEngine.open`` / ``open_engine`` run their real discovery path.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest
import torch
from recording_double import DEFAULT_SUPPORTED, INSTANCES, RecordingDoubleBackend, RecordingObserver

from rlinfer_core import hookimpl
from rlinfer_core.engine import AsyncEngine, open_engine
from rlinfer_core.errors import (
    EngineDead,
    EngineTimeout,
    InvalidRequest,
    UnsupportedCapability,
    WeightUpdateError,
)
from rlinfer_core.types import Capability, ChatMessage, EngineConfig, GenerateRequest, MemoryTag, SamplingParams
from rlinfer_core.weights import CheckpointDir, NamedTensors, WeightUpdate


@pytest.fixture(scope="module", autouse=True)
def double_entry_point(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    site = tmp_path_factory.mktemp("double_site")
    info = site / "rlinfer_double_backend-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlinfer-double-backend\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[rlinfer.backends]\ndouble = recording_double:DOUBLE_INFO\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.delenv("RLINFER_BACKENDS", raising=False)
        mp.delenv("RLINFER_PLUGINS", raising=False)
        importlib.invalidate_caches()
        yield


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def opened(observer: RecordingObserver | None = None, **engine_kwargs: Any) -> AsyncEngine:
    config = EngineConfig(model="m", request_timeout_s=engine_kwargs.pop("timeout", 5.0), engine_kwargs=engine_kwargs)
    return await AsyncEngine.open("double", config, plugins=[observer] if observer else [])


def backend() -> RecordingDoubleBackend:
    return INSTANCES[-1]


def good_update(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 2), scale), "b": torch.zeros(2)}


def test_open_generate_and_n_samples_in_order() -> None:
    async def body() -> None:
        engine = await opened()
        assert backend().started
        assert engine.model_info is not None and engine.model_info.vocab_size == 100
        reqs = [
            GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=3, n=2), request_id="a"),
            GenerateRequest(prompt_token_ids=[5], sampling=SamplingParams(max_tokens=2), request_id="b"),
        ]
        out = await engine.generate(reqs)
        assert [(c.request_id, c.index) for c in out] == [("a", 0), ("a", 1), ("b", 0)]
        assert out[0].token_ids == (3, 4, 5) and out[1].token_ids == (4, 5, 6)
        assert all(c.weight_version == 0 for c in out)
        assert await engine.generate([]) == []
        await engine.shutdown()
        await engine.shutdown()  # twice is fine
        assert backend().names().count("shutdown") == 1
        with pytest.raises(EngineDead):
            await engine.generate(reqs)

    run(body())


def test_weight_version_increments_once_per_success_and_prefix_cache_is_reset() -> None:
    async def body() -> None:
        engine = await opened()
        b = backend()
        assert engine.weight_version == 0
        assert await engine.update_weights(good_update(1.0)) == 1
        assert await engine.update_weights(NamedTensors.of(good_update(2.0))) == 2
        assert await engine.update_weights(WeightUpdate(NamedTensors.of(good_update(3.0)), version=10)) == 10
        assert engine.weight_version == 10
        names = [n for n in b.names() if n in ("update_weights", "reset_prefix_cache")]
        assert names == ["update_weights", "reset_prefix_cache"] * 3
        out = await engine.generate(GenerateRequest(prompt_token_ids=[1]))
        assert out[0].weight_version == 10
        with pytest.raises(WeightUpdateError, match="must be greater than the current version 10"):
            await engine.update_weights(good_update(), version=10)
        assert engine.weight_version == 10
        await engine.shutdown()

    run(body())


def test_a_backend_that_invalidates_prefixes_itself_is_not_reset_after_updates() -> None:
    """``update_invalidates_prefixes`` (vLLM's per-version cache salt): the facade leaves the
    prefix cache to the backend's update; the explicit reset_prefix_cache still reaches it."""

    async def body() -> None:
        engine = await opened()
        b = backend()
        b.update_invalidates_prefixes = True  # type: ignore[attr-defined]
        assert await engine.update_weights(good_update(1.0)) == 1
        assert [n for n in b.names() if n in ("update_weights", "reset_prefix_cache")] == ["update_weights"]
        await engine.reset_prefix_cache()
        assert b.names()[-1] == "reset_prefix_cache"
        await engine.shutdown()

    run(body())


@pytest.mark.parametrize(
    ("update", "problem"),
    [
        ({"w": torch.ones(3, 2), "b": torch.zeros(2)}, "w: shape (3, 2) != expected (2, 2)"),
        ({"w": torch.ones(2, 2, dtype=torch.float64)}, "w: dtype float64 != expected float32"),
        ({"nope": torch.ones(2)}, "nope: unknown parameter name"),
        ({"w": torch.full((2, 2), float("nan"))}, "w: holds NaN or inf"),
        ({}, "holds no tensors"),
    ],
)
def test_invalid_updates_never_reach_the_backend(update: dict[str, torch.Tensor], problem: str) -> None:
    async def body() -> None:
        observer = RecordingObserver()
        engine = await opened(observer)
        with pytest.raises(WeightUpdateError) as info:
            await engine.update_weights(update)
        assert any(problem in p for p in info.value.problems), info.value.problems
        assert engine.weight_version == 0
        assert "update_weights" not in backend().names()
        assert "reset_prefix_cache" not in backend().names()
        (failed,) = observer.of("weight_update_failed")
        assert failed["transport"] == "tensors" and failed["error"] is info.value
        assert observer.of("weights_updated") == []
        await engine.shutdown()

    run(body())


def test_backend_failure_keeps_version_and_is_typed() -> None:
    async def body() -> None:
        engine = await opened(fail_update=True)
        with pytest.raises(WeightUpdateError, match="simulated load failure"):
            await engine.update_weights(good_update())
        assert engine.weight_version == 0
        assert "update_weights" in backend().names()
        assert "reset_prefix_cache" not in backend().names()
        await engine.shutdown()

    run(body())


def test_unsupported_transport_is_refused_before_the_backend(tmp_path: Path) -> None:
    async def body() -> None:
        supported = [c.value for c in DEFAULT_SUPPORTED if c is not Capability.WEIGHTS_DISK]
        engine = await opened(supported=supported)
        with pytest.raises(UnsupportedCapability) as info:
            await engine.update_weights(CheckpointDir(str(tmp_path)))
        assert info.value.capability == "weights.disk"
        assert "update_weights" not in backend().names()
        assert engine.weight_version == 0
        await engine.shutdown()

    run(body())


def test_capability_checks() -> None:
    async def body() -> None:
        engine = await opened()  # no MEMORY_RELEASE, no CHAT
        with pytest.raises(UnsupportedCapability) as info:
            await engine.release_memory()
        assert info.value.capability == "memory.release"
        assert "the double holds no memory" in str(info.value)
        with pytest.raises(UnsupportedCapability) as info:
            await engine.generate(GenerateRequest(messages=[ChatMessage("user", "hi")]))
        assert info.value.capability == "generate.chat"
        assert not {"release_memory", "generate"} & set(backend().names())
        await engine.shutdown()

        engine = await opened(supported=[Capability.CHAT.value, Capability.MEMORY_RELEASE.value])
        out = await engine.generate(GenerateRequest(messages=[ChatMessage("user", "hi")]))
        assert len(out) == 1
        for needs in (
            SamplingParams(n=2),
            SamplingParams(logprobs=2),
            SamplingParams(prompt_logprobs=True),
            SamplingParams(stop=["x"]),
            SamplingParams(seed=3),
        ):
            with pytest.raises(UnsupportedCapability):
                await engine.generate(GenerateRequest(prompt_token_ids=[1], sampling=needs))
        with pytest.raises(UnsupportedCapability):
            await engine.pause("abort")
        await engine.release_memory(["kv_cache"])
        assert engine.released == {MemoryTag.KV_CACHE}
        with pytest.raises(InvalidRequest) as bad:
            await engine.generate(GenerateRequest(prompt_token_ids=[1]))
        assert bad.value.field == "engine_state"
        await engine.resume_memory()
        assert engine.released == frozenset()
        assert ("resume_memory", frozenset({MemoryTag.KV_CACHE})) in backend().calls
        with pytest.raises(InvalidRequest) as bad:
            await engine.release_memory(["gpu"])
        assert bad.value.field == "tags"
        await engine.shutdown()

    run(body())


def test_request_validation() -> None:
    async def body() -> None:
        engine = await opened()
        cases = [
            ([GenerateRequest(prompt_token_ids=[1, 100])], "prompt_token_ids", "item 1 must be < vocab_size (100)"),
            ([GenerateRequest(prompt_token_ids=[1] * 32)], "prompt_token_ids", "shorter than max_model_len (32)"),
            (
                [GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(stop_token_ids=[100]))],
                "stop_token_ids",
                "must be < vocab_size (100)",
            ),
            (
                [
                    GenerateRequest(prompt_token_ids=[1], request_id="x"),
                    GenerateRequest(prompt_token_ids=[2], request_id="x"),
                ],
                "request_id",
                "unique",
            ),
            (["not a request"], "requests", "GenerateRequest"),
        ]
        for batch, field, text in cases:
            with pytest.raises(InvalidRequest) as info:
                await engine.generate(batch)  # type: ignore[arg-type]
            assert info.value.field == field
            assert text in str(info.value)
        assert "generate" not in backend().names()
        out = await engine.generate(GenerateRequest(prompt_token_ids=[99] * 31))
        assert len(out) == 1
        await engine.shutdown()

    run(body())


def test_generate_timeout_raises_and_aborts_the_requests() -> None:
    async def body() -> None:
        engine = await opened(timeout=0.2, generate_delay_s=30.0)
        reqs = [GenerateRequest(prompt_token_ids=[1], request_id=r) for r in ("t1", "t2")]
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(EngineTimeout, match="request_timeout_s"):
            await engine.generate(reqs)
        assert loop.time() - started < 5
        assert ("abort", ["t1", "t2"]) in backend().calls
        await engine.shutdown()

    run(body())


def test_stream_concatenates_and_times_out() -> None:
    async def body() -> None:
        engine = await opened()
        request = GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=4))
        deltas = [d async for d in engine.stream(request)]
        (whole,) = await engine.generate(request)
        assert tuple(t for d in deltas for t in d.token_ids) == whole.token_ids
        assert [d.finish_reason for d in deltas][-1] == whole.finish_reason
        await engine.shutdown()

        engine = await opened(timeout=0.2, generate_delay_s=0.15)
        request = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=10), request_id="s")
        with pytest.raises(EngineTimeout):
            async for _ in engine.stream(request):
                pass
        assert ("abort", ["s"]) in backend().calls
        await engine.shutdown()

    run(body())


def test_sync_engine_wrapper() -> None:
    observer = RecordingObserver()
    with open_engine("double", model="m", plugins=[observer]) as engine:
        (c,) = engine.generate(GenerateRequest(prompt_token_ids=[3], sampling=SamplingParams(max_tokens=2)))
        assert c.token_ids == (3, 4)
        assert engine.update_weights(good_update()) == 1
        assert engine.weight_version == 1
        assert set(engine.weight_specs) == {"w", "b"}
        deltas = list(engine.stream(GenerateRequest(prompt_token_ids=[3], sampling=SamplingParams(max_tokens=2))))
        assert [d.token_ids for d in deltas] == [(3,), (4,)]
        engine.abort("zzz")
        engine.pause("keep")
        engine.resume()
        engine.reset_prefix_cache()
        engine.check_health()
        with pytest.raises(UnsupportedCapability):
            engine.release_memory()
    assert engine.async_engine._calls.closed
    assert ("abort", ["zzz"]) in backend().calls
    kinds = [e for e, _ in observer.events]
    assert kinds[0] == "started" and kinds[-1] == "shutdown"
    engine.shutdown()  # second call is a no-op


def test_observer_plugins_receive_events() -> None:
    async def body() -> None:
        observer = RecordingObserver()
        engine = await opened(observer)
        (started,) = observer.of("started")
        assert started["backend"] == "double" and started["capabilities"] == engine.capabilities
        out = await engine.generate(GenerateRequest(prompt_token_ids=[1], request_id="r"))
        (done,) = observer.of("generate_done")
        assert done["completions"] == out and done["requests"][0].request_id == "r"
        await engine.update_weights(good_update())
        (updated,) = observer.of("weights_updated")
        assert updated == {"version": 1, "transport": "tensors", "nbytes": 4 * 4 + 2 * 4}
        await engine.shutdown()
        assert observer.of("shutdown") == [{"backend": "double"}]

    run(body())


class WrongArgumentName:
    @hookimpl
    async def rlinfer_generate(self, reqs: Any) -> None:  # the spec's argument is "requests"
        return None


class UnknownHook:
    @hookimpl
    def rlinfer_not_a_hook(self) -> None:
        return None


@pytest.mark.parametrize("plugin", [WrongArgumentName(), UnknownHook()])
def test_observers_with_operation_hooks_are_refused_at_registration(plugin: Any) -> None:
    from recording_double import DOUBLE_INFO

    with pytest.raises(InvalidRequest, match="observers may implement only"):
        AsyncEngine(DOUBLE_INFO, RecordingDoubleBackend(), EngineConfig(model="m"), [plugin])


class WrongEventArguments:
    @hookimpl
    def rlinfer_on_engine_started(self, backend: str, not_an_argument: int) -> None:
        return None


def test_bad_event_hookimpls_are_rejected_at_registration() -> None:
    from recording_double import DOUBLE_INFO

    with pytest.raises(pluggy.PluginValidationError):
        AsyncEngine(DOUBLE_INFO, RecordingDoubleBackend(), EngineConfig(model="m"), [WrongEventArguments()])


def test_an_online_quantized_engine_needs_quantized_reload() -> None:
    """engine_kwargs quantization (an engine quantizing a BF16 checkpoint itself) is refused before
    the backend starts unless it claims weights.quantized_reload; its weight specs stay the
    checkpoint's either way."""

    async def body() -> None:
        with pytest.raises(UnsupportedCapability) as info:
            await opened(supported=[Capability.WEIGHTS_TENSORS.value], quantization="fp8")
        assert info.value.capability == Capability.WEIGHTS_QUANTIZED_RELOAD.value
        assert not backend().started
        claims = [Capability.WEIGHTS_TENSORS.value, Capability.WEIGHTS_QUANTIZED_RELOAD.value]
        engine = await opened(supported=claims, quantization="fp8")
        assert backend().started
        await engine.update_weights(good_update(2.0))
        assert engine.weight_version == 1
        await engine.shutdown()

    run(body())


def test_a_backend_property_that_raises_before_start_is_not_run_at_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Older pluggy ``getattr``s every attribute when it looks for hook implementations; the pool's
    properties raise until it has started (the GPU machine's pluggy failed to register the pool).
    The project's manager skips properties, so registering such a backend works on any pluggy:
    checked here under a stand-in for the old lookup."""
    from rlinfer_core.hookspecs import PluginManager

    newer_lookup = pluggy.PluginManager.parse_hookimpl_opts

    def older_pluggys_lookup(self: Any, plugin: Any, name: str) -> Any:
        getattr(plugin, name)  # what pluggy did before it read attributes statically
        return newer_lookup(self, plugin, name)

    monkeypatch.setattr(pluggy.PluginManager, "parse_hookimpl_opts", older_pluggys_lookup)

    class NotStartedDouble:
        @property
        def replicas(self) -> Any:
            raise EngineDead("the pool has not started")

        @hookimpl
        def rlinfer_capabilities(self) -> Any:
            return None

    manager = PluginManager()
    manager.register(NotStartedDouble(), name="double")
    assert [impl.plugin_name for impl in manager.hook.rlinfer_capabilities.get_hookimpls()] == ["double"]
