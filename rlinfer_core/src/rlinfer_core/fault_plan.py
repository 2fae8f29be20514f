"""Faults planted into an engine's own weight loading, for the conformance kit only.

The kit proves that a verified update catches an engine that loads something other than what it
was sent (``EngineConfig.verify_updates``). No input can make a healthy engine do that, so the
kit plants the fault where the engine loads: when ``$RLINFER_FAULT_PLAN`` names a file that
exists, the backends' engine-side loaders pass every update through :func:`planted`, which
changes the tensors the file lists (``{"corrupt": [names]}``) before the engine loads them. The
variable is inherited by every engine process the kit starts; the file exists only while a fault
test runs. Without the variable this costs one environment lookup per update.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV = "RLINFER_FAULT_PLAN"


def planted(tensors: Sequence[tuple[str, Any]]) -> Sequence[tuple[str, Any]]:
    """``tensors`` with the planted faults applied (new tensors: the sender's are untouched)."""
    path = os.environ.get(ENV)
    if not path or not Path(path).is_file():
        return tensors
    names = set(json.loads(Path(path).read_text()).get("corrupt", ()))
    return [(name, tensor + 1 if name in names else tensor) for name, tensor in tensors]
