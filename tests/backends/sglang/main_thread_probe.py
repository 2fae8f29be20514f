"""Run by test_sglang_main_thread.py in a fresh interpreter: an AsyncEngine on the main thread.

There SGLang installs process-wide signal handlers (SIGTERM, and a SIGQUIT handler that kills the
whole process when a child fails). Prints a JSON line with what was observed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import psutil

from rlinfer_core.engine import AsyncEngine
from rlinfer_core.errors import EngineDead
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import GenerateRequest, SamplingParams


def _callers_handler(signum: int, frame: Any) -> None:
    """The caller's own SIGTERM handler, which must survive the engine start."""


async def main(model: str) -> None:
    signal.signal(signal.SIGTERM, _callers_handler)
    engine = await AsyncEngine.open("sglang", model=model, dtype="float32", max_model_len=256)
    out: dict[str, Any] = {}
    request = GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(temperature=0.0, max_tokens=2))
    await engine.generate(request)
    out["sigterm_kept"] = signal.getsignal(signal.SIGTERM) is _callers_handler
    backend: Any = engine._backend
    scheduler = next(p for p in backend.engine_processes() if psutil.Process(p).name() == "sglang::scheduler")
    long = GenerateRequest(
        prompt_token_ids=[1, 2], sampling=SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    )
    task = asyncio.ensure_future(engine.generate(long))
    await asyncio.sleep(0.2)
    killed = time.monotonic()
    os.kill(scheduler, signal.SIGKILL)
    try:
        await task
        out["engine_dead"] = False
    except EngineDead:
        out["engine_dead"] = True
    out["seconds"] = time.monotonic() - killed
    await asyncio.sleep(2.0)  # SGLang's own crash handling would have killed this process by now
    await engine.shutdown()
    out["survived"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(str(make_tiny_model(sys.argv[1], seed=0))))
