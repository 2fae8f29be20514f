"""Server mode, attached: ``EngineConfig(server_url=...)`` drives an SGLang server someone else
started.

One real ``python -m sglang.launch_server`` process (tiny model, CPU) is started by the test
itself, not by rlinfer; engines attach to it, and the test checks that rlinfer treats it as not
its own: no engine processes reported, shutdown leaves it serving, a second client sees the first
one's update, a 4xx names the field, a killed server is EngineDead.

Runs only with ``RLINFER_SGLANG_SERVER_TESTS=1`` (``make test-sglang-server``): each SGLang server
start takes about a minute on 2 cores, too long for ``make test-sglang``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_server_helpers import FIELDS as BASE_FIELDS
from sglang_server_helpers import PROMPTS, SERVER_TESTS

from rlinfer_core.engine import open_engine
from rlinfer_core.errors import BackendLoadError, EngineDead, InvalidRequest
from rlinfer_core.server_child import ChildServer, free_port
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import EngineConfig, GenerateRequest, SamplingParams
from rlinfer_core.weights import CheckpointDir

pytest.importorskip("sglang")
pytestmark = SERVER_TESTS

FIELDS: dict[str, Any] = BASE_FIELDS
MAX_TOKENS = 6


class External:
    """An SGLang server started outside rlinfer, with the options the README gives for attaching."""

    def __init__(self, model: Path) -> None:
        from rlinfer_sglang.config import server_args
        from rlinfer_sglang.transport.launch import make_server, server_argv, server_env

        config = EngineConfig(model=str(model), **FIELDS)
        port = free_port()
        self.process: ChildServer = make_server(
            server_argv(server_args(config, "cpu"), "127.0.0.1", port), server_env(config, "cpu")
        )
        self.process.start(f"http://127.0.0.1:{port}")
        self.url = self.process.url

    def wait(self) -> None:
        import httpx

        async def go() -> None:
            async with httpx.AsyncClient() as client:
                await asyncio.wait_for(self.process.wait_healthy(client), timeout=600)

        asyncio.run(go())

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("sglang-attach")
    return make_tiny_model(base / "seed0", seed=0), make_tiny_model(base / "seed1", seed=1)


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path]) -> Iterator[External]:
    external = External(models[0])
    try:
        external.wait()
        yield external
    finally:
        external.process.stop()


def _attach(models: tuple[Path, Path], url: str) -> Any:
    return open_engine("sglang", model=str(models[0]), server_url=url, load_entry_point_plugins=False, **FIELDS)


def hf_greedy(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations by Hugging Face transformers (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
        out.append(gen[0, len(prompt) :].tolist())
    return out


def _greedy(engine: Any) -> list[list[int]]:
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=sampling) for p in PROMPTS])
    return [list(c.token_ids) for c in out]


def test_attach_serves_reports_no_processes_and_leaves_the_server_running(
    server: External, models: tuple[Path, Path]
) -> None:
    engine = _attach(models, server.url)
    try:
        assert engine.engine_processes() == {}, "an attached server is not this engine's to kill"
        assert _greedy(engine) == hf_greedy(models[0], PROMPTS, MAX_TOKENS)
    finally:
        engine.shutdown()
    assert server.healthy(), "shutdown of an attached engine stopped the server"
    assert server.process.exited() is None


def test_a_4xx_is_invalid_request_naming_the_field(server: External) -> None:
    """SGLang's own refusals (a pydantic 422, a ValueError's 400) map to InvalidRequest, and the
    server keeps serving."""
    from rlinfer_core.server_http import ServerClient

    async def go() -> tuple[InvalidRequest, InvalidRequest]:
        client = ServerClient(server.url, 30.0, "SGLang")
        try:
            with pytest.raises(InvalidRequest) as typed:
                await client.post("/generate", {"input_ids": {"not": "ids"}})
            with pytest.raises(InvalidRequest) as value:
                await client.post("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1.0}})
            return typed.value, value.value
        finally:
            await client.aclose()

    typed, value = asyncio.run(go())
    assert typed.field == "input_ids", typed
    assert "temperature" in str(value), value
    assert server.healthy()


def test_second_client_sees_the_first_clients_update(server: External, models: tuple[Path, Path]) -> None:
    first = _attach(models, server.url)
    try:
        first.update_weights(CheckpointDir(str(models[1])))
        after = first.generate(
            [GenerateRequest(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(temperature=0.0, max_tokens=3))]
        )[0]
        assert after.token_versions == (1, 1, 1), "tokens after the update carry the new version"
    finally:
        first.shutdown()
    second = _attach(models, server.url)
    try:
        assert _greedy(second) == hf_greedy(models[1], PROMPTS, MAX_TOKENS)
        second.update_weights(CheckpointDir(str(models[0])))  # leave the server as it was
    finally:
        second.shutdown()


def test_server_options_are_the_server_args(models: tuple[Path, Path]) -> None:
    """The launcher spells every ServerArgs value as the ``sglang serve`` option SGLang's parser
    maps back onto the same value."""
    from rlinfer_sglang.config import server_args
    from rlinfer_sglang.transport.launch import SERVER_OVERRIDES, _parser, server_argv

    config = EngineConfig(model=str(models[0]), enable_prefix_caching=False, **FIELDS)
    kwargs = server_args(config, "cpu")
    parsed = vars(_parser().parse_args(server_argv(kwargs, "127.0.0.1", 8123)))
    for key, value in kwargs.items():
        assert parsed[key] == SERVER_OVERRIDES.get(key, value), key
    assert (parsed["host"], parsed["port"]) == ("127.0.0.1", 8123)


def test_nothing_listening_is_a_load_error(models: tuple[Path, Path]) -> None:
    with pytest.raises(BackendLoadError, match="no healthy SGLang server"):
        _attach(models, f"http://127.0.0.1:{free_port()}")


def test_killed_server_is_engine_dead_for_an_attached_engine(server: External, models: tuple[Path, Path]) -> None:
    engine = _attach(models, server.url)
    try:
        assert engine.generate([GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2))])
        pid = server.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDead):
            engine.generate([GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2))])
        assert time.monotonic() - started < 5.0
        with pytest.raises(EngineDead):
            engine.check_health()
    finally:
        engine.shutdown()
