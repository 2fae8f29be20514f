"""An engine's HTTP server as a child process: free port, launch, wait for health, track, stop.

Engine-agnostic (no engine import): the server transports (``rlinfer_vllm.transport.http``,
``rlinfer_sglang.transport.http``) give it the command line (:func:`command_line` spells engine
arguments with the engine's own parser) and a name for each process role. The
server runs in its own session (a Ctrl-C in the caller's terminal reaches only the caller, whose
shutdown then stops the server in order) and writes its output to a log file whose tail is shown
when it fails to start. Needs psutil and httpx (``rlinfer-core[backend]`` plus the engine's own
dependencies).
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
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlinfer_core import processes
from rlinfer_core.errors import BackendLoadError

HOST = "127.0.0.1"
#: how often :meth:`ChildServer.wait_healthy` polls the health endpoint
HEALTH_POLL_S = 0.25
#: SIGTERM grace before the server's processes are killed at shutdown
SHUTDOWN_GRACE_S = 10.0


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def command_line(parser: argparse.ArgumentParser, arguments: Mapping[str, Any], command: str) -> list[str]:
    """The options of ``command`` (e.g. ``vllm serve``) for keyword ``arguments`` named as
    ``parser``'s destinations, checked by ``parser``; None values are left out. An argument the
    parser has no option for, or options it refuses, are a :class:`BackendLoadError`."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in arguments.items():
        if value is None:
            continue
        action = actions.get(key)
        if action is None:
            raise BackendLoadError(f"argument {key!r} has no `{command}` option (server mode)")
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
        raise BackendLoadError(f"`{command}` refused the options {argv}") from exc
    return argv


def _cmdline_has(proc: Any, needles: Sequence[str]) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
    except Exception:  # exited meanwhile, or not ours to read
        return False
    return any(n in cmdline for n in needles)


class ChildServer:
    """One engine server child process (``command``) and the processes it starts.

    ``name`` names the engine in errors and in the log directory (``rlinfer-<name>-server-*``).
    """

    def __init__(self, command: Sequence[str], name: str, env: Mapping[str, str] | None = None) -> None:
        self.command = list(command)
        self.name = name
        self.env = dict(env or {})
        self.url = ""
        self._log = Path(tempfile.mkdtemp(prefix=f"rlinfer-{name.lower()}-server-")) / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        #: psutil processes: the server, then every descendant seen once it was healthy
        self.tracked: list[Any] = []

    def start(self, url: str) -> None:
        """Spawn the server, which will serve at ``url`` (returns at once; see :meth:`wait_healthy`)."""
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self.url = url
        atexit.register(self.stop)  # an interpreter that exits without shutdown() stops it too

    @property
    def pid(self) -> int | None:
        """The server's pid (None before start)."""
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> Path:
        """The file the server's output goes to."""
        return self._log

    def exited(self) -> int | None:
        """The server's exit code, or None while it runs."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's output."""
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_healthy(self, client: Any, health_path: str = "/health") -> None:
        """Poll ``health_path`` with the ``httpx.AsyncClient`` ``client`` until it answers 200;
        BackendLoadError (with the log's tail) if the server exits first. The caller bounds the
        wait (the facade's startup timeout cancels it). Then the server's processes are tracked."""
        import httpx

        while True:
            code = self.exited()
            if code is not None:
                raise BackendLoadError(
                    f"the {self.name} server exited with code {code} while starting:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                response = await client.get(f"{self.url}{health_path}", timeout=2.0)
                if response.status_code == 200:
                    break
            await asyncio.sleep(HEALTH_POLL_S)
        self.track()

    def track(self) -> None:
        """Record the server and its descendants now running (interpreter helpers excluded)."""
        import psutil  # type: ignore[import-untyped,unused-ignore]

        assert self._proc is not None
        root = psutil.Process(self._proc.pid)
        kids = [p for p in root.children(recursive=True) if not _cmdline_has(p, processes.INTERPRETER_HELPERS)]
        self.tracked = [root, *kids]

    def roles(self, server_role: str, namer: Callable[[str], str]) -> dict[str, int]:
        """``{role: pid}`` of the running tracked processes: the server itself as
        ``server_role``, the others as ``namer(process name)`` (made unique with their pid)."""
        roles: dict[str, int] = {}
        for proc in processes.alive(self.tracked):
            if proc.pid == self.pid:
                roles[server_role] = proc.pid
                continue
            try:
                title = proc.name()
            except Exception:  # exited meanwhile
                continue
            role = namer(title) or f"pid-{proc.pid}"
            if role in roles:
                role = f"{role}-{proc.pid}"
            roles[role] = proc.pid
        return roles

    def dead(self) -> list[int]:
        """Pids of tracked processes that are no longer running."""
        running = {p.pid for p in processes.alive(self.tracked)}
        return [p.pid for p in self.tracked if p.pid not in running]

    def stop(self) -> None:
        """SIGTERM the server (which stops its own children), wait, then kill whatever of its
        processes is left; reap them all. Safe to call twice."""
        proc = self._proc
        if proc is None:
            return
        atexit.unregister(self.stop)
        earlier = list(self.tracked)
        with contextlib.suppress(Exception):  # children started since the last look (or before health)
            self.track()
        now = {p.pid for p in self.tracked}
        self.tracked += [p for p in earlier if p.pid not in now]
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


async def launch(
    make: Callable[[int], ChildServer], client: Any, tries: int = 3, health_path: str = "/health"
) -> ChildServer:
    """Start ``make(port)`` on a free port and wait until healthy; another port when the first
    was taken meanwhile (up to ``tries``). A failed or cancelled start leaves no process behind."""
    loop = asyncio.get_running_loop()
    for attempt in range(tries):
        port = free_port()
        server = make(port)
        server.start(f"http://{HOST}:{port}")
        try:
            await server.wait_healthy(client, health_path)
            return server
        except BackendLoadError as exc:
            await loop.run_in_executor(None, server.stop)
            if "address already in use" not in str(exc).lower() or attempt == tries - 1:
                raise
        except BaseException:  # cancelled by the startup timeout
            await asyncio.shield(loop.run_in_executor(None, server.stop))
            raise
    raise AssertionError("unreachable")


__all__ = ["HOST", "ChildServer", "free_port", "launch"]
