"""A killed vLLM engine core surfaces as EngineDead within seconds; shutdown still cleans up."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_test_helpers import ENGINE_FIELDS

from rlinfer_core.engine import Engine, open_engine
from rlinfer_core.errors import EngineDead
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import GenerateRequest, SamplingParams

DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model: Path = make_tiny_model(tmp_path_factory.mktemp("vllm-death") / "seed0", seed=0)
    # eager mode skips torch.compile's warm-up (~15 s here); death handling does not depend on it
    eng = open_engine("vllm", model=str(model), load_entry_point_plugins=False, enforce_eager=True, **ENGINE_FIELDS)
    try:
        yield eng
    finally:
        eng.shutdown()


def test_killed_engine_core_is_engine_dead(engine: Engine) -> None:
    import psutil

    backend = engine.async_engine._backend
    pids = backend.transport.engine_processes()
    core = [pid for pid in pids if "EngineCore" in psutil.Process(pid).name()]
    assert core, [psutil.Process(pid).name() for pid in pids]
    # a long request is in flight when the engine core dies
    long = GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    loop_future = engine.async_engine.generate([long])
    import asyncio

    pending = asyncio.run_coroutine_threadsafe(loop_future, engine._loop)
    time.sleep(0.2)
    os.kill(core[0], signal.SIGKILL)

    started = time.perf_counter()
    while True:
        try:
            engine.check_health()
        except EngineDead:
            break
        assert time.perf_counter() - started < DEADLINE_S, "check_health did not report the dead engine"
        time.sleep(0.05)
    with pytest.raises(EngineDead):
        pending.result(timeout=DEADLINE_S)
    with pytest.raises(EngineDead):
        engine.generate([GenerateRequest(prompt_token_ids=[5], sampling=SamplingParams(max_tokens=2))])

    engine.shutdown()
    assert backend.transport.engine_processes() == []
    left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not left
