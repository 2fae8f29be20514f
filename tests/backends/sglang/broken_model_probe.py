"""Run by test_sglang_signals.py in a fresh interpreter: the sync Engine (engine loop off the main
thread) on a checkpoint whose weights are corrupt. SGLang's scheduler fails while loading and
sends SIGQUIT to this process; the caller must get BackendLoadError and live on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil

from rlinfer_core.engine import Engine
from rlinfer_core.errors import BackendLoadError
from rlinfer_core.tiny_model import make_tiny_model

if __name__ == "__main__":
    model = make_tiny_model(sys.argv[1], seed=0)
    weights = next(Path(model).glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    out: dict[str, object] = {}
    try:
        Engine.open("sglang", model=str(model), dtype="float32")
        out["error"] = None
    except BackendLoadError as exc:
        out["error"] = type(exc).__name__
    children = psutil.Process().children(recursive=True)
    out["children"] = [" ".join(p.cmdline()) for p in children if "resource_tracker" not in " ".join(p.cmdline())]
    print(json.dumps(out))
