"""Killing the detokenizer (found through ``engine_processes()``) makes the next call raise
EngineDead within 5 s, shutdown leaves no process behind, and a new engine opens afterwards.
(The scheduler's death is covered in test_sglang_engine.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")

import psutil

from rlinfer_core.engine import Engine
from rlinfer_core.errors import EngineDead
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import GenerateRequest, SamplingParams


def _request() -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0, max_tokens=4))


def test_detokenizer_death_then_a_new_engine(tmp_path: Path) -> None:
    model = str(make_tiny_model(tmp_path / "m", seed=0))
    engine = Engine.open("sglang", model=model, dtype="float32", seed=0, max_model_len=128)
    try:
        roles = engine.engine_processes()
        assert set(roles) == {"scheduler", "detokenizer"}
        assert len(engine.generate(_request())[0].token_ids) == 4
        os.kill(roles["detokenizer"], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDead):
            engine.generate(_request())
        assert time.monotonic() - killed < 5.0
    finally:
        engine.shutdown()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in roles.values())
    again = Engine.open("sglang", model=model, dtype="float32", seed=0, max_model_len=128)
    try:
        assert len(again.generate(_request())[0].token_ids) == 4
    finally:
        again.shutdown()
