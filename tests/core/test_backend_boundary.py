"""The typed backend boundary (rlinfer_core.backend), the optional bench protocol, stream's
capability/timeout path, transports dispatched by match, and the core's import layering."""

from __future__ import annotations

import ast
import asyncio
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from recording_double import DEFAULT_SUPPORTED, DOUBLE_INFO, INSTANCES, RecordingDoubleBackend

from rlinfer_core.backend import Backend, BenchBackend, FullBackend, StreamingBackend, check_backend
from rlinfer_core.engine import AsyncEngine, transport_capability, transport_name
from rlinfer_core.errors import BackendLoadError, EngineTimeout, InvalidRequest, UnsupportedCapability
from rlinfer_core.preflight import TRANSPORT_CAPABILITY
from rlinfer_core.types import Capability, EngineConfig, GenerateRequest, SamplingParams
from rlinfer_core.weights import BroadcastSource, Buckets, CheckpointDir, NamedTensors, TensorSpec

ROOT = Path(__file__).resolve().parents[2]


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
        importlib.invalidate_caches()
        yield


async def opened(**engine_kwargs: Any) -> AsyncEngine:
    config = EngineConfig(model="m", request_timeout_s=engine_kwargs.pop("timeout", 5.0), engine_kwargs=engine_kwargs)
    return await AsyncEngine.open("double", config, load_entry_point_plugins=False)


def test_the_double_satisfies_the_protocols() -> None:
    double = RecordingDoubleBackend()
    assert isinstance(double, Backend)
    assert isinstance(double, StreamingBackend)
    assert isinstance(double, BenchBackend)
    assert not isinstance(double, FullBackend)  # no checksum, no engine processes
    assert check_backend("double", double) is double


def test_a_factory_result_without_the_required_hooks_is_refused() -> None:
    class Half:
        async def rlinfer_start(self, config: EngineConfig) -> None: ...

    with pytest.raises(BackendLoadError) as info:
        AsyncEngine(DOUBLE_INFO, Half(), EngineConfig(model="m"))
    message = str(info.value)
    assert "rlinfer_generate" in message and "rlinfer_update_weights" in message
    assert "rlinfer_start" not in message


@pytest.mark.parametrize(
    ("capability", "without", "needs"),
    [
        (Capability.WEIGHTS_CHECKSUM, (), "rlinfer_weights_checksum"),
        (Capability.TOOLS, ("rlinfer_parse_tool_calls",), "rlinfer_parse_tool_calls"),
        (Capability.LORA, ("rlinfer_unload_lora",), "rlinfer_unload_lora"),
    ],
)
def test_claiming_a_capability_without_its_hooks_fails_open_and_shuts_down(
    capability: Capability, without: tuple[str, ...], needs: str
) -> None:
    async def body() -> None:
        with pytest.raises(BackendLoadError) as info:
            await opened(supported=[capability.value], without=without)
        assert f"{capability.value} needs {needs}" in str(info.value)
        assert INSTANCES[-1].names()[-1] == "shutdown"

    asyncio.run(body())


def test_bench_is_an_optional_capability() -> None:
    async def body() -> None:
        request = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=3, n=2))
        engine = await opened(supported=[c.value for c in DEFAULT_SUPPORTED if c is not Capability.BENCH])
        with pytest.raises(UnsupportedCapability) as info:
            await engine.bench_raw_generate([request])
        assert info.value.capability == "bench"
        with pytest.raises(UnsupportedCapability):
            await engine.bench_raw_weight_update("/nowhere")
        assert not any(n.startswith("bench") for n in INSTANCES[-1].names())
        await engine.shutdown()

        engine = await opened()
        assert await engine.bench_raw_generate([request]) == 6
        await engine.bench_raw_weight_update("/some/dir")
        assert INSTANCES[-1].names()[-1] == "bench_raw_weight_update"  # the raw path only: no reset
        await engine.shutdown()

    asyncio.run(body())


def test_stream_is_checked_when_called_like_generate() -> None:
    async def body() -> None:
        engine = await opened(supported=[c.value for c in DEFAULT_SUPPORTED if c is not Capability.STREAM])
        with pytest.raises(UnsupportedCapability) as info:
            engine.stream(GenerateRequest(prompt_token_ids=[1]))  # no iteration needed
        assert info.value.capability == "generate.stream"
        await engine.shutdown()

        engine = await opened(supported=[Capability.STREAM.value])
        with pytest.raises(UnsupportedCapability) as info:
            engine.stream(GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(logprobs_mode="raw")))
        assert info.value.capability == "logprobs.raw"
        with pytest.raises(Exception, match="vocab_size"):
            engine.stream(GenerateRequest(prompt_token_ids=[10_000]))
        assert "stream" not in INSTANCES[-1].names()
        await engine.shutdown()

    asyncio.run(body())


def test_a_stream_is_bounded_as_a_whole_and_leaves_no_request_in_flight() -> None:
    async def body() -> None:
        # each delta comes faster than the timeout, the whole stream does not
        engine = await opened(timeout=0.5, generate_delay_s=0.1)
        request = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=20), request_id="slow")
        seen = 0
        with pytest.raises(EngineTimeout):
            async for _ in engine.stream(request):
                seen += 1
        assert 1 <= seen < 20
        assert ("abort", ["slow"]) in INSTANCES[-1].calls
        assert engine.in_flight == frozenset()
        await engine.shutdown()

    asyncio.run(body())


def test_transports_are_dispatched_exhaustively(tmp_path: Path) -> None:
    sources = [
        NamedTensors.of({"w": torch.zeros(1)}),
        Buckets(()),
        CheckpointDir(str(tmp_path)),
        BroadcastSource((TensorSpec("w", "float32", (1,)),)),
    ]
    for source in sources:
        assert transport_capability(source) is TRANSPORT_CAPABILITY[type(source)]
    assert [transport_name(s) for s in sources] == ["tensors", "buckets", "disk", "broadcast"]
    with pytest.raises(AssertionError):
        transport_capability(object())  # type: ignore[arg-type]


# --- layering ----------------------------------------------------------------------------------

FORBIDDEN = ("rlinfer_conformance", "rlinfer_vllm", "rlinfer_sglang", "rlinfer_ray", "rlinfer_server", "rlinfer_demo")


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value


def test_the_core_imports_no_kit_and_no_backend() -> None:
    """Every import in rlinfer_core, at module level or inside functions, stays in the core layer."""
    src = ROOT / "rlinfer_core" / "src" / "rlinfer_core"
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted(src.rglob("*.py"))
        for line, name in _imports(path)
        if name.split(".")[0] in FORBIDDEN
    ]
    assert bad == [], "the core must not reach the kit, a backend or an add-on:\n" + "\n".join(bad)


def test_no_source_file_of_the_four_packages_is_over_500_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for folder in ("rlinfer_core/src", "rlinfer_vllm/src", "rlinfer_sglang/src", "conformance/src")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 500
    ]
    assert long == []


# --- backend logic shared in the core ------------------------------------------------------------


def test_capabilities_without_drops_only_claimed_ones_with_their_reason() -> None:
    from rlinfer_core.types import Capabilities

    caps = Capabilities("b", "1", "cpu", {Capability.CHAT, Capability.LORA}, {"abort": "never"})
    off = caps.without({Capability.CHAT: "no chat template", Capability.ABORT: "ignored: not claimed"})
    assert off.supported == {Capability.LORA}
    assert off.notes == {"abort": "never", "generate.chat": "no chat template"}
    assert caps.without({}) is caps and caps.without({Capability.ABORT: "x"}) is caps


def test_prompt_ids_render_messages_with_the_chat_template(tmp_path: Path) -> None:
    from rlinfer_core.chat_template import load_tokenizer, prompt_ids
    from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model
    from rlinfer_core.types import ChatMessage

    tok = load_tokenizer(str(make_tiny_model(tmp_path / "m", seed=0, spec=TinyModelSpec(num_hidden_layers=1))))
    assert prompt_ids(None, GenerateRequest(prompt_token_ids=[3, 4]), 8) == [3, 4]
    chat = GenerateRequest(messages=[ChatMessage("user", "hi")])
    ids = prompt_ids(tok, chat, 1024)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    for tokenizer, limit, says in [(None, 1024, "no tokenizer"), (tok, len(ids), "max_model_len")]:
        with pytest.raises(InvalidRequest) as info:
            prompt_ids(tokenizer, chat, limit)
        assert info.value.field == "messages" and says in str(info.value)


def test_start_in_thread_hands_an_abandoned_start_to_its_cleanup() -> None:
    import threading

    from rlinfer_core.processes import start_in_thread

    started, release = threading.Event(), threading.Event()
    abandoned: list[str] = []

    def slow_start() -> str:
        started.set()
        release.wait(10)
        return "engine"

    def cleanup(future: asyncio.Future[str]) -> None:
        abandoned.append(future.result())

    async def body() -> None:
        assert await start_in_thread(lambda: "up", cleanup) == "up"
        task = asyncio.ensure_future(start_in_thread(slow_start, cleanup))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()  # as the facade's startup timeout does
        with pytest.raises(asyncio.CancelledError):
            await task
        assert abandoned == [], "premise: the start is still running in its thread"
        release.set()
        for _ in range(500):
            if abandoned:
                break
            await asyncio.sleep(0.01)

    asyncio.run(body())
    assert abandoned == ["engine"], "the start finished after the cancel and reached its cleanup"
