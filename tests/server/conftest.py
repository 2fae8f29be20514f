"""One real ``rlinfer serve`` (vLLM CPU by default) for the whole server test session.

The engine uses the kit's small settings (rlinfer_conformance.world.default_config), written to a
YAML config file, so the server is also started through ``--config``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

BACKEND = os.environ.get("RLINFER_SERVER_TEST_BACKEND", "vllm")
API_KEY = "test-control-key-0123456789abcdef"
MODEL_NAME = "tiny"
START_TIMEOUT_S = 600.0
#: the shared server reads tool calls with the hermes parser and takes request chat templates
SERVER_OPTIONS = ("--tool-call-parser", "hermes", "--trust-request-chat-template")


@attrs.frozen
class Served:
    """A running server: where it listens, its key, its process and the two tiny models."""

    url: str
    api_key: str
    proc: subprocess.Popen[bytes]
    base_model: Path
    other_model: Path
    log: Path

    @property
    def control_headers(self) -> dict[str, str]:
        """Headers that pass the control endpoints' guard."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc.poll() is None


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from rlinfer_core.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return make_tiny_model(root / "seed0", seed=0), make_tiny_model(root / "seed1", seed=1)


def write_config(path: Path, model: Path) -> Path:
    """The kit's engine settings as a verl-style ``rollout:`` YAML file."""
    import yaml

    from rlinfer_conformance.world import default_config

    config = default_config(model, {})
    fields = {f.name: getattr(config, f.name) for f in attrs.fields(type(config))}
    # plain values only: nested settings (attrs objects such as default sampling) keep their defaults
    plain = {k: v for k, v in fields.items() if v is not None and k != "engine_kwargs" and not attrs.has(type(v))}
    rollout = {"name": BACKEND, **plain}
    rollout["tensor_model_parallel_size"] = rollout.pop("tensor_parallel_size")  # verl's name
    path.write_text(yaml.safe_dump({"rollout": rollout}))
    return path


@contextlib.contextmanager
def run_serve(
    config: Path, tmp: Path, models: tuple[Path, Path], *args: str, env: dict[str, str] | None = None
) -> Iterator[Served]:
    """``rlinfer serve --config CONFIG ARGS...`` as a subprocess on a free port, once it serves;
    stopped (SIGTERM, then its whole process group killed) afterwards."""
    ready, log = tmp / "ready.json", tmp / "server.log"
    cmd = [sys.executable, "-m", "rlinfer_core.cli", "serve", "--config", str(config), "--port", "0"]
    cmd += ["--served-model-name", MODEL_NAME, "--ready-file", str(ready), "--log-level", "warning", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ.copy(), start_new_session=True
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"rlinfer serve {' '.join(args)} did not start (rc={proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    info = json.loads(ready.read_text())
    try:
        yield Served(f"http://{info['host']}:{info['port']}", API_KEY, proc, *models, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def completion_of(extra: dict[str, Any], finish_reason: str) -> tuple[Any, Any]:
    """(request, completion) of a completion choice's extra fields, for the kit's oracle."""
    from rlinfer_core.types import Completion, FinishReason, GenerateRequest, SamplingParams

    request = GenerateRequest(prompt_token_ids=extra["prompt_token_ids"], sampling=SamplingParams(temperature=0))
    completion = Completion(
        request_id=request.request_id,
        index=0,
        prompt_token_ids=tuple(extra["prompt_token_ids"]),
        token_ids=tuple(extra["token_ids"]),
        logprobs=tuple(extra["token_logprobs"]),
        finish_reason=FinishReason(finish_reason),
    )
    return request, completion


@pytest.fixture(scope="session")
def server(tiny_models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("server")
    config = write_config(tmp / "rollout.yaml", tiny_models[0])
    env = dict(os.environ, RLINFER_API_KEY=API_KEY)
    with run_serve(config, tmp, tiny_models, *SERVER_OPTIONS, env=env) as served:
        yield served


@pytest.fixture(scope="session")
def client(server: Served):  # type: ignore[no-untyped-def]
    """An ``openai`` client on the server (generation is open: no generate key is set)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120.0, max_retries=0)
