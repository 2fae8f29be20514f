"""Process supervision: starting SGLang's processes, signals, death detection and shutdown.

SGLang's crash handling kills the *whole calling process* (SIGQUIT handler calling
``kill_process_tree(os.getpid())``) and its shutdown kills *every* child of the caller. A trainer
must survive both, so the backend replaces that handling: SGLang's subprocess watchdog is
stopped, its SIGQUIT/SIGTERM handlers are replaced or restored, a monitor task turns a dead
scheduler into :class:`EngineDead` within about a second, and shutdown kills only the processes
the engine start created.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from rlinfer_core import processes
from rlinfer_core.errors import BackendLoadError, EngineDead
from rlinfer_core.types import EngineConfig
from rlinfer_sglang.capabilities import Platform
from rlinfer_sglang.config import server_args
from rlinfer_sglang.engine_env import engine_environment

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: how often the monitor checks that the engine's processes are alive
MONITOR_INTERVAL_S = 0.5


def _on_sigquit(signum: int, frame: Any) -> None:
    """SIGQUIT from a failing SGLang child: SGLang's own handler would kill this whole process.

    Module-level (SGLang pickles its server args, handler included, into the scheduler). The
    failing child exits right after; each backend's monitor then turns that into EngineDead.
    """
    logger.error("an SGLang process reported a failure (SIGQUIT); its engine will report EngineDead")


#: engines that rely on SIGQUIT being ignored at the libc level (see _guard_sigquit)
_SIGQUIT_IGNORERS = 0


def _libc_sigquit(action: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(int(signal.SIGQUIT), action)


def _guard_sigquit(main_thread: bool) -> str:
    """Keep SGLang's SIGQUIT from killing this process; returns how ("handler", "ignored", "").

    On the main thread a Python handler is installed. Elsewhere Python cannot install one, so
    when SIGQUIT still has its default action (terminate + core) it is ignored through libc
    (process-wide) while an engine runs; a handler the program installed itself is left alone.
    """
    global _SIGQUIT_IGNORERS
    if main_thread:
        signal.signal(signal.SIGQUIT, _on_sigquit)
        return "handler"
    if _SIGQUIT_IGNORERS == 0 and signal.getsignal(signal.SIGQUIT) is not signal.SIG_DFL:
        return ""
    if _SIGQUIT_IGNORERS == 0:
        _libc_sigquit(1)  # SIG_IGN
    _SIGQUIT_IGNORERS += 1
    return "ignored"


def _unguard_sigquit(kind: str) -> None:
    """Undo :func:`_guard_sigquit` for an engine that shut down."""
    global _SIGQUIT_IGNORERS
    if kind == "ignored":
        _SIGQUIT_IGNORERS -= 1
        if _SIGQUIT_IGNORERS == 0:
            _libc_sigquit(0)  # SIG_DFL


def ensure_cpu_env(platform: str) -> None:
    """Set SGLANG_USE_CPU_ENGINE on CPU: SGLang reads it when its modules are imported."""
    if platform == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"


class Supervision:
    """Starts the engine's processes, watches them and shuts them down (in this process).

    The in-process transport owns one: it drives the engine through :attr:`tokenizer_manager`
    and races its calls against the engine's death with :meth:`guard`.
    """

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self._engine: Engine | None = None
        self._tm: Any = None  #: SGLang's TokenizerManager (in this process)
        self._closed = False
        self._dead: str | None = None
        self._dead_event: asyncio.Event | None = None
        self._procs: list[Any] = []
        self._monitor: asyncio.Task[None] | None = None
        self._signals: dict[int, Any] = {}
        self._quit_guard = ""

    @property
    def tokenizer_manager(self) -> Any:
        """SGLang's TokenizerManager (in this process); None before start and after shutdown."""
        return self._tm

    @property
    def engine(self) -> Engine | None:
        """SGLang's Engine; None before start and after shutdown."""
        return self._engine

    @property
    def dead(self) -> str | None:
        """Why the engine died or was shut down; None while it runs."""
        return self._dead

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        if self._dead_event is not None:
            self._dead_event.set()

    def alive(self) -> None:
        """Raise EngineDead when the engine is shut down or died."""
        if self._closed or self._tm is None:
            raise EngineDead("the SGLang engine is shut down; open a new engine")
        if self._dead is not None:
            raise EngineDead(f"the SGLang engine died ({self._dead}); open a new engine")

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` unless the engine dies first (then raise EngineDead)."""
        assert self._dead_event is not None
        task = asyncio.ensure_future(awaitable)
        dead = asyncio.ensure_future(self._dead_event.wait())
        try:
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            dead.cancel()
            raise
        dead.cancel()
        if task.done():
            return task.result()
        task.cancel()
        self.alive()
        raise EngineDead("the SGLang engine died")

    async def launch(self, config: EngineConfig) -> None:
        """Start SGLang's Engine (scheduler + detokenizer processes) and take over its process care."""
        ensure_cpu_env(self.platform)
        try:
            from sglang.srt.entrypoints.engine import Engine
        except Exception as exc:
            raise BackendLoadError(f"cannot import SGLang: {type(exc).__name__}: {exc}") from exc
        self._dead_event = asyncio.Event()
        kwargs = server_args(config, self.platform)
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:
            self._signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGQUIT)}
        # A child failing (at launch or later) sends SIGQUIT to this process; with SGLang's
        # handler, or none, that kills the caller. The engine starts in a worker thread, where
        # SGLang installs no handler, so rlinfer takes SIGQUIT over first.
        self._quit_guard = _guard_sigquit(main_thread)
        before = processes.snapshot()
        added = engine_environment(config, self.platform)  # the scheduler inherits these
        os.environ.update(added)
        try:
            engine = await processes.start_in_thread(lambda: Engine(**kwargs), lambda f: self._kill_late(f, before))
        except Exception as exc:
            processes.kill(processes.started_since(before), grace_s=2.0)
            self._restore_signals()
            raise BackendLoadError(f"SGLang failed to start for model {config.model!r}: {exc}") from exc
        finally:
            for name in added:
                os.environ.pop(name, None)
        self._engine = engine
        self._tm = engine.tokenizer_manager
        self._procs = processes.started_since(before)
        self._take_over_process_care(engine, main_thread)
        self._monitor = asyncio.ensure_future(self._watch())

    def _take_over_process_care(self, engine: Engine, main_thread: bool) -> None:
        atexit.unregister(engine.shutdown)
        atexit.register(self._kill_now)
        watchdog = getattr(self._tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it would SIGQUIT this process when a child dies
            self._tm._subprocess_watchdog = None
        # SGLang installs its loop signal handlers on first use; do it now and undo them.
        self._tm.auto_create_handle_loop()
        if main_thread:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGQUIT):
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)
            with contextlib.suppress(Exception):
                signal.signal(signal.SIGTERM, self._signals[signal.SIGTERM])
            with contextlib.suppress(Exception):
                loop.add_signal_handler(signal.SIGQUIT, _on_sigquit, signal.SIGQUIT, None)

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            running = processes.alive(self._procs)
            if len(running) < len(self._procs):
                gone = sorted({p.pid for p in self._procs} - {p.pid for p in running})
                self._mark_dead(f"SGLang process(es) {gone} exited")
            if self._dead is not None:
                # the rest of the engine is useless now; leave no orphans behind
                await asyncio.get_running_loop().run_in_executor(None, processes.kill, self._procs, 2.0)
                return

    async def check_health(self) -> None:
        """Raise EngineDead when an engine process died or the engine was shut down."""
        self.alive()
        if len(processes.alive(self._procs)) < len(self._procs):
            self._mark_dead("an SGLang process exited")
            self.alive()

    async def shutdown(self) -> None:
        """Stop the engine; kill exactly the processes its start created (none is left)."""
        if self._closed:
            return
        self._closed = True
        self._mark_dead("shut down")
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(BaseException):
                await self._monitor
        await asyncio.get_running_loop().run_in_executor(None, self._kill_now)
        tm, self._tm = self._tm, None
        if tm is not None:
            for task in list(getattr(tm, "asyncio_tasks", ())):
                task.cancel()
            with contextlib.suppress(Exception):
                tm.cuda_vmm_feature_transport.shutdown()
            mm = getattr(tm, "mm_processor", None)
            if mm is not None:
                with contextlib.suppress(Exception):
                    mm.shutdown()
            _destroy_zmq_context(tm)
        engine, self._engine = self._engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.send_to_rpc.close(linger=0)
            atexit.unregister(self._kill_now)
        self._restore_signals()

    def _restore_signals(self) -> None:
        if self._quit_guard == "handler" and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGQUIT)
            with contextlib.suppress(Exception):
                signal.signal(signal.SIGQUIT, self._signals[signal.SIGQUIT])
        else:
            _unguard_sigquit(self._quit_guard)
        self._quit_guard = ""

    def _kill_now(self) -> None:
        processes.kill(self._procs, grace_s=3.0)

    @staticmethod
    def _kill_late(future: asyncio.Future[Any], before: set[int]) -> None:
        """An engine whose start was cancelled (startup timeout): kill what it started."""
        processes.kill(processes.started_since(before), grace_s=2.0)

    def processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the engine's running processes ("scheduler", "detokenizer", ...)."""
        roles: dict[str, int] = {}
        for proc in processes.alive(self._procs):
            try:
                name = proc.name()
            except Exception:  # exited meanwhile
                continue
            role = name.removeprefix("sglang::") or f"pid-{proc.pid}"
            if role in roles:
                role = f"{role}-{proc.pid}"
            roles[role] = proc.pid
        return roles

    def all_engine_processes(self) -> list[int]:
        """Pids of every process the engine start created (alive or not)."""
        return [p.pid for p in self._procs]


def _destroy_zmq_context(tm: Any) -> None:
    """Close the tokenizer manager's zmq sockets without lingering and end their context.

    Otherwise the context's ``__del__`` (at some later garbage collection, e.g. pytest's exit)
    blocks forever in ``term()`` on a PUSH socket whose peer, the scheduler, is gone.
    """
    sock = getattr(tm, "recv_from_detokenizer", None)
    context = getattr(sock, "context", None)
    if context is not None:
        with contextlib.suppress(Exception):
            context.destroy(linger=0)
