"""Server mode, attached: ``EngineConfig(server_url=...)`` drives a vLLM server someone else started.

One real ``vllm serve`` process (tiny model, CPU) is started by the test itself, not by rlinfer;
engines attach to it, and the test checks that rlinfer treats it as not its own: no engine
processes reported, shutdown leaves it serving, a second client sees the first one's update.
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

pytest.importorskip("vllm")

from vllm_test_helpers import ENGINE_FIELDS, PROMPTS, hf_greedy, state_dict

from rlinfer_core.engine import open_engine
from rlinfer_core.errors import BackendLoadError, EngineDead, InvalidRequest
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import EngineConfig, GenerateRequest, SamplingParams
from rlinfer_core.weights import CheckpointDir

MAX_TOKENS = 6


class External:
    """A vLLM server started outside rlinfer with the flags the README gives for attaching, but
    without rlinfer's batch middleware (a plain server: generate falls back to one call per
    request)."""

    def __init__(self, model: Path, base: Path) -> None:
        from rlinfer_core.server_child import free_port
        from rlinfer_vllm.config import engine_args
        from rlinfer_vllm.transport.server_command import server_argv, server_process

        config = EngineConfig(model=str(model), enforce_eager=True, **ENGINE_FIELDS)
        port = free_port()
        argv = server_argv(engine_args(config, "cpu"), "127.0.0.1", port)
        at = argv.index("--middleware")
        del argv[at : at + 2]
        self.process = server_process(argv, {})
        self.url = f"http://127.0.0.1:{port}"
        self.process.start(self.url)

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
    base = tmp_path_factory.mktemp("vllm-attach")
    return make_tiny_model(base / "seed0", seed=0), make_tiny_model(base / "seed1", seed=1)


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[External]:
    external = External(models[0], tmp_path_factory.mktemp("vllm-attach-logs"))
    try:
        external.wait()
        yield external
    finally:
        external.process.stop()


def _attach(models: tuple[Path, Path], url: str, **extra: Any) -> Any:
    fields = {**ENGINE_FIELDS, **extra}
    return open_engine("vllm", model=str(models[0]), server_url=url, load_entry_point_plugins=False, **fields)


def _greedy(engine: Any) -> list[list[int]]:
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=sampling) for p in PROMPTS])
    return [list(c.token_ids) for c in out]


def test_attach_serves_reports_no_processes_and_leaves_the_server_running(
    server: External, models: tuple[Path, Path]
) -> None:
    import httpx

    from rlinfer_vllm.api_server.batch_route import PATH

    # premise: the server has no batch endpoint, so the greedy batch below went one call each
    assert httpx.post(f"{server.url}{PATH}", json={"requests": []}, timeout=30.0).status_code == 404
    engine = _attach(models, server.url)
    try:
        assert engine.engine_processes() == {}, "an attached server is not this engine's to kill"
        # no middleware to say that its token endpoint takes cache_salt: updates reset the prefix cache
        assert not engine.async_engine._backend.transport.salted
        assert _greedy(engine) == hf_greedy(models[0], state_dict(models[0]), PROMPTS, MAX_TOKENS)
        with pytest.raises(InvalidRequest) as bad:  # a 4xx from the server names vLLM's field
            engine.generate([GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=2, n=64))])
        assert "max_num_seqs" in str(bad.value)
    finally:
        engine.shutdown()
    assert server.healthy(), "shutdown of an attached engine stopped the server"
    assert server.process.exited() is None


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
        # attaching does not rebuild the worker's state from the checkpoint: seed1 is still served
        assert _greedy(second) == hf_greedy(models[1], state_dict(models[1]), PROMPTS, MAX_TOKENS)
        assert second.verify_weights(state_dict(models[1])).ok
        second.update_weights(CheckpointDir(str(models[0])))  # leave the server as it was
    finally:
        second.shutdown()


def test_server_options_are_the_engine_arguments() -> None:
    """The launcher spells every engine argument as the ``vllm serve`` option vLLM's parser maps
    back onto the same value (booleans both ways)."""
    from rlinfer_vllm.config import engine_args
    from rlinfer_vllm.transport.server_command import SERVER_OVERRIDES, _parser, server_argv

    config = EngineConfig(model="/m", enable_prefix_caching=False, enforce_eager=True, **ENGINE_FIELDS)
    kwargs = engine_args(config, "cpu")
    parsed = vars(_parser().parse_args(server_argv(kwargs, "127.0.0.1", 8123)))
    for key, value in kwargs.items():
        assert parsed[key] == SERVER_OVERRIDES.get(key, value), key
    assert (parsed["host"], parsed["port"], parsed["max_logprobs"]) == ("127.0.0.1", 8123, 21)
    assert parsed["enable_scale_out"] is True
    assert parsed["middleware"] == ["rlinfer_vllm.api_server.batch_route.BatchRoute"]


def test_nothing_listening_is_a_load_error(models: tuple[Path, Path]) -> None:
    from rlinfer_core.server_child import free_port

    with pytest.raises(BackendLoadError, match="no healthy vLLM server"):
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
