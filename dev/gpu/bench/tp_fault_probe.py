"""Kill one process of a tensor-parallel vLLM/SGLang engine and time what rlinfer reports.

    python3 dev/gpu/bench/tp_fault_probe.py --backend vllm --role Worker-1 --tp 2 [--json-out F]

Opens an engine on a tiny model made on the fly, generates, SIGKILLs the process of ``--role``
(a key of ``engine.engine_processes()``), then times the next generate (must raise EngineDead),
the health check and shutdown, and lists processes left behind. If anything blocks longer than
``--stall-s``, the Python stacks of every thread are printed (faulthandler) and the probe exits.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any


def probe(args: argparse.Namespace) -> dict[str, Any]:
    from rlinfer_core.sync_engine import Engine
    from rlinfer_core.tiny_model import make_tiny_model
    from rlinfer_core.types import GenerateRequest, SamplingParams

    model = make_tiny_model(tempfile.mkdtemp(prefix="probe-"), seed=0)
    result: dict[str, Any] = {"backend": args.backend, "role": args.role, "tp": args.tp}
    kwargs: dict[str, Any] = {"tensor_parallel_size": args.tp, "request_timeout_s": 60.0}
    for item in args.config:
        key, value = item.split("=", 1)
        kwargs[key] = json.loads(value) if value[:1] in "0123456789[{tf" else value
    started = time.monotonic()
    engine = Engine.open(args.backend, model=str(model), **kwargs)
    result["open_s"] = time.monotonic() - started
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0, max_tokens=4))
    engine.generate([request])
    procs = dict(engine.engine_processes())
    result["processes"] = procs
    os.kill(procs[args.role], signal.SIGKILL)
    started = time.monotonic()
    try:
        engine.generate([request])
        result["generate_after_kill"] = "returned"
    except Exception as exc:
        result["generate_after_kill"] = type(exc).__name__
    result["generate_after_kill_s"] = time.monotonic() - started
    try:
        engine.check_health()
        result["health"] = "ok"
    except Exception as exc:
        result["health"] = type(exc).__name__
    started = time.monotonic()
    engine.shutdown()
    result["shutdown_s"] = time.monotonic() - started
    time.sleep(1.0)
    result["left_behind"] = [pid for pid in procs.values() if os.path.exists(f"/proc/{pid}")]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--role", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--config", action="append", default=[], help="EngineConfig field=value")
    parser.add_argument("--stall-s", type=float, default=150.0)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.stall_s, exit=True)
    result = probe(args)
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(result), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(0 if result["generate_after_kill"] == "EngineDead" and not result["left_behind"] else 1)


if __name__ == "__main__":
    main()
