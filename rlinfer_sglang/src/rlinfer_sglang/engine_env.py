"""Environment variables an SGLang engine needs, for the in-process engine's processes (set in
this process around the start) and for a server child (its environment only).

Only variables the caller has not set are returned: the caller's choice always wins.
"""

from __future__ import annotations

import os

from rlinfer_core.cpu_binding import binding_for
from rlinfer_core.types import EngineConfig
from rlinfer_sglang.config import needs_context_override

#: SGLang's per-TP-rank CPU core binding on CPU ("0-3|4-7": cores of rank 0 | rank 1)
THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"
#: torch_memory_saver keeps the pinned host buffer of the weights' backup between releases instead
#: of allocating it at each release and freeing it at each resume. Measured on an H100 (1.26 GB of
#: weights, 39 GiB freed): release 0.555 -> 0.071 s, resume 0.173 -> 0.056 s; the first release
#: still allocates it (0.75 s). The price: host memory the size of the weights (per rank), pinned
#: for the engine's life once it released its weights.
RETAIN_BACKUP = "TMS_RETAIN_CPU_BACKUP"


def engine_environment(config: EngineConfig, platform: str) -> dict[str, str]:
    """What to add to the environment of the engine's processes."""
    env: dict[str, str] = {}
    if platform == "cpu":
        if "OMP_NUM_THREADS" not in os.environ:
            # without it torch uses every core and, with the caller's own threads, CPU decoding
            # jitters by an order of magnitude
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
        binding = binding_for(config.tensor_parallel_size * config.data_parallel_size)
        if binding is not None and THREADS_BIND not in os.environ:
            env[THREADS_BIND] = binding
    if platform == "cuda" and config.enable_memory_release and RETAIN_BACKUP not in os.environ:
        env[RETAIN_BACKUP] = "1"
    if needs_context_override(config) and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" not in os.environ:
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    return env
