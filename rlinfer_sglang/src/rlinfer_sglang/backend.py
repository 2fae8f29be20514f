"""The SGLang backend: rlinfer's operation hooks over SGLang's offline ``Engine``.

SGLang's Engine keeps its tokenizer manager in the caller's process and event loop and runs the
scheduler (model + KV cache) and the detokenizer in child processes. This object drives the
tokenizer manager's async API directly (the Engine's sync wrappers would block the loop).

Weight updates go through SGLang's ``update_weights_from_tensor`` (inside
``begin_weight_update``/``end_weight_update``) with rlinfer's scheduler-side loader
(:mod:`rlinfer_sglang.scheduler_side`), which reads and checks everything before loading.

Process hygiene: SGLang's crash handling kills the *whole calling process* (SIGQUIT handler
calling ``kill_process_tree(os.getpid())``) and its shutdown kills *every* child of the caller.
A trainer must survive both, so this backend replaces that handling: SGLang's subprocess
watchdog is stopped, its SIGQUIT/SIGTERM handlers are replaced or restored, a monitor task
turns a dead scheduler into :class:`EngineDead` within about a second, and shutdown kills only
the processes the engine start created.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from rlinfer_core.errors import BackendLoadError, EngineDead, InvalidRequest, RLInferError, WeightUpdateError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.types import (
    Capabilities,
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import (
    BroadcastGroup,
    BroadcastSource,
    Bucket,
    Buckets,
    CheckpointDir,
    NamedTensors,
    TensorSpec,
    WeightUpdate,
)

from rlinfer_core import processes
from rlinfer_sglang import convert
from rlinfer_sglang.capabilities import capabilities, installed_platform, installed_version
from rlinfer_sglang.config import WEIGHT_LOADER, needs_context_override, resolve_platform, server_args

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: how often the monitor checks that the engine's processes are alive
MONITOR_INTERVAL_S = 0.5


def create(config: EngineConfig) -> SGLangBackend:
    """Factory named by the ``rlinfer.backends: sglang`` entry point."""
    return SGLangBackend(config)


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


def _ensure_cpu_env(platform: str) -> None:
    # SGLang reads SGLANG_USE_CPU_ENGINE when its modules are imported; it must be set first.
    if platform == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"


class SGLangBackend:
    """Implements rlinfer's operation hooks for one SGLang engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config, installed_platform())
        version = installed_version()
        self.engine_version = f"sglang {version}" if version else "not installed"
        self._caps = capabilities(
            self.platform, self.engine_version, config.enable_memory_release if self.platform == "cuda" else None
        )
        self._engine: Engine | None = None
        self._tm: Any = None
        self._closed = False
        self._dead: str | None = None
        self._dead_event: asyncio.Event | None = None
        self._procs: list[Any] = []
        self._monitor: asyncio.Task[None] | None = None
        self._info: ModelInfo | None = None
        self._specs: dict[str, TensorSpec] = {}
        self._tp_size = config.tensor_parallel_size
        #: rlinfer request id -> SGLang rids of its samples now in flight
        self._rids: dict[str, set[str]] = {}
        self._aborted: set[str] = set()
        self._gate: asyncio.Event | None = None  # set = requests may start
        self._idle: asyncio.Event | None = None  # set = no sample in flight
        self._active = 0
        self._sglang_paused = False
        self._memory_paused = False  # SGLang paused by release_memory (it needs an idle scheduler)
        self._released: set[MemoryTag] = set()
        self._cache_dirty = True
        self._result_dir = Path(tempfile.mkdtemp(prefix="rlinfer-sglang-"))
        self._signals: dict[int, Any] = {}
        self._quit_guard = ""
        self.start_seconds: float | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Start SGLang's Engine (scheduler + detokenizer processes) and take over its process care."""
        _ensure_cpu_env(self.platform)
        try:
            from sglang.srt.entrypoints.engine import Engine
        except Exception as exc:
            raise BackendLoadError(f"cannot import SGLang: {type(exc).__name__}: {exc}") from exc
        loop = asyncio.get_running_loop()
        self._dead_event = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        started = time.perf_counter()
        kwargs = server_args(config, self.platform)
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:
            self._signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGQUIT)}
        # A child failing (at launch or later) sends SIGQUIT to this process; with SGLang's
        # handler, or none, that kills the caller. The engine starts in a worker thread, where
        # SGLang installs no handler, so rlinfer takes SIGQUIT over first.
        self._quit_guard = _guard_sigquit(main_thread)
        before = processes.snapshot()
        env_omp = os.environ.get("OMP_NUM_THREADS")
        if self.platform == "cpu" and env_omp is None:
            # the scheduler inherits this; without it torch uses every core and, with the
            # caller's own threads, CPU decoding jitters by an order of magnitude
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
        override = needs_context_override(config) and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" not in os.environ
        if override:
            os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
        future = loop.run_in_executor(None, lambda: Engine(**kwargs))
        try:
            engine = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda f: self._kill_late(f, before))
            raise
        except Exception as exc:
            processes.kill(processes.started_since(before), grace_s=2.0)
            self._restore_signals()
            raise BackendLoadError(f"SGLang failed to start for model {config.model!r}: {exc}") from exc
        finally:
            if self.platform == "cpu" and env_omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            if override:
                os.environ.pop("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", None)
        self._engine = engine
        self._tm = engine.tokenizer_manager
        self._procs = processes.started_since(before)
        self._take_over_process_care(engine, main_thread)
        self._monitor = asyncio.ensure_future(self._watch())
        self._info = self._model_info()
        self._specs = self._weight_specs()
        self._caps = self._runtime_capabilities()
        self.start_seconds = time.perf_counter() - started

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

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        if self._dead_event is not None:
            self._dead_event.set()

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

    def _model_info(self) -> ModelInfo:
        mc = self._tm.model_config
        eos = sorted(int(t) for t in (getattr(mc, "hf_eos_token_id", None) or ()))
        tokenizer = getattr(self._tm, "tokenizer", None)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in eos:
            eos.append(tok_eos)
        # SGLang keeps a few positions of the context in reserve: the longest prompt it accepts is
        # max_req_input_len (context_len - 6 on 0.5.23). Report the length it really serves.
        max_len = int(mc.context_len)
        limit = getattr(self._tm, "max_req_input_len", None)
        if self.config.max_model_len is not None:
            max_len = self.config.max_model_len
        elif isinstance(limit, int) and 0 < limit < max_len:
            max_len = limit + 1
        return ModelInfo(vocab_size=int(mc.vocab_size), max_model_len=max_len, eos_token_ids=tuple(eos))

    def _weight_specs(self) -> dict[str, TensorSpec]:
        from rlinfer_core.transfer.disk import read_specs

        # SGLang casts what it loads to the served dtype. With dtype="auto" (where SGLang may serve
        # a float32 checkpoint in float16) the checkpoint's own dtypes are what a trainer holds and
        # what a checkpoint directory contains; with an explicit dtype, that dtype.
        served = None if self.config.dtype == "auto" else str(self._tm.model_config.dtype).removeprefix("torch.")
        try:
            found = read_specs(self._model_dir())
        except RLInferError as exc:
            raise BackendLoadError(f"cannot read the parameter names of {self.config.model!r}: {exc}") from exc
        return {name: TensorSpec(name, served or spec.dtype, spec.shape) for name, spec in found.items()}

    def _model_dir(self) -> str:
        if Path(self.config.model).is_dir():
            return self.config.model
        from huggingface_hub import snapshot_download

        return str(snapshot_download(self.config.model, allow_patterns=["*.safetensors", "*.json"]))

    def _runtime_capabilities(self) -> Capabilities:
        caps = self._caps
        tokenizer = getattr(self._tm, "tokenizer", None)
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            notes = dict(caps.notes)
            notes[Capability.CHAT.value] = "the model's tokenizer has no chat template"
            caps = attrs.evolve(caps, supported=caps.supported - {Capability.CHAT}, notes=notes)
        return caps

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        """Capabilities on this platform (refined at start: chat needs a chat template)."""
        return self._caps

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        """Vocabulary size, context length and EOS ids of the served model."""
        if self._info is None:
            raise EngineDead("the SGLang engine is not started")
        return self._info

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        """Raise EngineDead when an engine process died or the engine was shut down."""
        self._alive()
        if len(processes.alive(self._procs)) < len(self._procs):
            self._mark_dead("an SGLang process exited")
            self._alive()

    def _alive(self) -> Any:
        if self._closed or self._tm is None:
            raise EngineDead("the SGLang engine is shut down; open a new engine")
        if self._dead is not None:
            raise EngineDead(f"the SGLang engine died ({self._dead}); open a new engine")
        return self._tm

    async def _guard(self, awaitable: Awaitable[T]) -> T:
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
        self._alive()
        raise EngineDead("the SGLang engine died")

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
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
        engine, self._engine = self._engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.send_to_rpc.close(linger=0)
            atexit.unregister(self._kill_now)
        shutil.rmtree(self._result_dir, ignore_errors=True)
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

    def engine_processes(self) -> list[int]:
        """Pids of the processes the engine started that are still running."""
        return [p.pid for p in processes.alive(self._procs)]

    def all_engine_processes(self) -> list[int]:
        """Pids of every process the engine start created (alive or not)."""
        return [p.pid for p in self._procs]

    # --- generate ------------------------------------------------------------------------------

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        assert request.messages is not None
        tokenizer = getattr(self._tm, "tokenizer", None)
        if tokenizer is None:
            raise InvalidRequest("messages", "the engine has no tokenizer; send prompt_token_ids")
        try:
            text = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in request.messages],
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as exc:
            raise InvalidRequest("messages", f"the chat template failed: {exc}") from exc
        ids = list(tokenizer.encode(str(text), add_special_tokens=False))
        if not ids:
            raise InvalidRequest("messages", "the chat template produced an empty prompt")
        if len(ids) >= self._max_len():
            raise InvalidRequest(
                "messages", f"the templated prompt has {len(ids)} tokens, max_model_len is {self._max_len()}"
            )
        return ids

    def _max_len(self) -> int:
        assert self._info is not None
        return self._info.max_model_len

    async def _admit(self, request_id: str) -> bool:
        """Wait until requests may start (pause); False when the request was aborted meanwhile."""
        assert self._gate is not None and self._idle is not None
        await self._wait_gate([request_id])
        if request_id in self._aborted:
            return False
        self._active += 1
        self._idle.clear()
        self._cache_dirty = True
        return True

    async def _wait_gate(self, request_ids: list[str]) -> None:
        """Hold requests back while paused; return early once all of them are aborted."""
        assert self._gate is not None
        while not self._gate.is_set() and not all(r in self._aborted for r in request_ids):
            self._alive()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate.wait(), timeout=0.05)

    def _release(self) -> None:
        assert self._idle is not None
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Send every sample to SGLang as one batch; n completions per request, in request order.

        One batched ``GenerateReqInput`` (not one call per sample) lets SGLang's scheduler see
        the whole batch at once, exactly as a native batched ``async_generate`` call does.
        """
        self._alive()
        prompts = [self._prompt_ids(r) for r in requests]
        samples = [(r, i, ids) for r, ids in zip(requests, prompts, strict=True) for i in range(r.sampling.n)]
        started = time.perf_counter()
        admitted = await self._admit_all([r.request_id for r, _, _ in samples])
        rids = [uuid.uuid4().hex if ok else "" for ok in admitted]
        for (r, _, _), rid in zip(samples, rids, strict=True):
            if rid:
                self._rids.setdefault(r.request_id, set()).add(rid)
        live = [k for k, rid in enumerate(rids) if rid]
        outs: dict[int, Any] = {}
        try:
            if live:
                results = await self._guard(
                    self._tm_generate_batch([samples[k] for k in live], [rids[k] for k in live])
                )
                outs = dict(zip(live, results, strict=True))
        except asyncio.CancelledError:
            for k in live:
                self._abort_rid(rids[k])
            raise
        except RLInferError:
            raise
        except Exception as exc:
            if not all(r.request_id in self._aborted for r, _, _ in samples):
                raise self._translate(exc) from exc
        finally:
            for (r, _, _), rid in zip(samples, rids, strict=True):
                if rid:
                    self._untrack(r.request_id, rid)
                    self._release()
            for r in requests:
                if r.request_id not in self._rids:
                    self._aborted.discard(r.request_id)
        latency = time.perf_counter() - started
        return [
            convert.completion(r, i, ids, outs[k], latency)
            if k in outs
            else convert.aborted_before_output(r, i, ids, latency)
            for k, (r, i, ids) in enumerate(samples)
        ]

    async def _admit_all(self, request_ids: list[str]) -> list[bool]:
        assert self._gate is not None and self._idle is not None
        await self._wait_gate(request_ids)
        admitted = [rid not in self._aborted for rid in request_ids]
        count = sum(admitted)
        if count:
            self._active += count
            self._idle.clear()
            self._cache_dirty = True
        return admitted

    def _tm_generate_batch(self, samples: list[tuple[GenerateRequest, int, list[int]]], rids: list[str]) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        if len(samples) == 1:
            (request, _, ids), rid = samples[0], rids[0]
            return self._wrap_one(
                self._tm_generate(ids, convert.sampling_params(request, len(ids), self._max_len()), rid, request)
            )
        args = [convert.logprob_args(r) for r, _, _ in samples]
        obj = GenerateReqInput(
            input_ids=[ids for _, _, ids in samples],
            sampling_params=[convert.sampling_params(r, len(ids), self._max_len()) for r, _, ids in samples],
            rid=rids,
            return_logprob=[a["return_logprob"] for a in args],
            logprob_start_len=[a["logprob_start_len"] for a in args],
            top_logprobs_num=[a["top_logprobs_num"] for a in args],
        )
        return self._tm.generate_request(obj, None).__anext__()

    @staticmethod
    async def _wrap_one(awaitable: Awaitable[Any]) -> list[Any]:
        return [await awaitable]

    def _tm_generate(
        self, ids: list[int], params: dict[str, Any], rid: str, request: GenerateRequest, stream: bool = False
    ) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=ids, sampling_params=params, rid=rid, stream=stream, **convert.logprob_args(request)
        )
        generator = self._tm.generate_request(obj, None)
        return generator if stream else generator.__anext__()

    def _untrack(self, request_id: str, rid: str) -> None:
        rids = self._rids.get(request_id)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self._rids[request_id]

    def _abort_rid(self, rid: str) -> None:
        with contextlib.suppress(Exception):
            self._tm.abort_request(rid=rid)

    def _translate(self, exc: Exception) -> Exception:
        if self._dead is not None:
            return EngineDead(f"the SGLang engine died ({self._dead}): {exc}")
        if isinstance(exc, ValueError):
            return InvalidRequest("request", f"SGLang rejected it: {exc}")
        return exc

    @hookimpl
    async def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream deltas of every sample (SGLang streams cumulative outputs; deltas are cut here)."""
        self._alive()
        ids = self._prompt_ids(request)
        queue: asyncio.Queue[CompletionDelta | BaseException | None] = asyncio.Queue()

        async def one(index: int) -> None:
            try:
                async for d in self._stream_sample(request, index, ids):
                    queue.put_nowait(d)
            except BaseException as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(one(i)) for i in range(request.sampling.n)]
        pending = len(tasks)
        try:
            while pending:
                item = await queue.get()
                if item is None:
                    pending -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._aborted.discard(request.request_id)

    async def _stream_sample(
        self, request: GenerateRequest, index: int, ids: list[int]
    ) -> AsyncIterator[CompletionDelta]:
        from rlinfer_core.types import FinishReason

        if not await self._admit(request.request_id):
            yield CompletionDelta(request.request_id, index, (), (), FinishReason.ABORT)
            return
        rid = uuid.uuid4().hex
        self._rids.setdefault(request.request_id, set()).add(rid)
        params = convert.sampling_params(request, len(ids), self._max_len())
        seen = 0
        finished = False
        try:
            generator = self._tm_generate(ids, params, rid, request, stream=True)
            while not finished:
                try:
                    out = await self._guard(generator.__anext__())
                except StopAsyncIteration:
                    break
                d, seen = convert.delta(request, index, out, seen)
                if d is not None:
                    finished = d.finish_reason is not None
                    if finished and not (out.get("meta_info") or {}).get("finish_reason"):
                        self._abort_rid(rid)  # rlinfer ended it (stop id under ignore_eos)
                    yield d
            if not finished:
                yield CompletionDelta(request.request_id, index, (), (), FinishReason.ABORT)
        except (asyncio.CancelledError, GeneratorExit):
            self._abort_rid(rid)
            raise
        except RLInferError:
            raise
        except Exception as exc:
            raise self._translate(exc) from exc
        finally:
            self._untrack(request.request_id, rid)
            self._release()

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request in flight); their callers get "abort"."""
        self._alive()
        ids = list(self._rids) if request_ids is None else list(request_ids)
        for request_id in ids:
            self._aborted.add(request_id)
            for rid in list(self._rids.get(request_id, ())):
                self._abort_rid(rid)
        for request_id in ids:  # ids not in flight now must not poison later requests
            if request_id not in self._rids and (self._gate is None or self._gate.is_set()):
                self._aborted.discard(request_id)

    # --- pause -------------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """abort -> SGLang "abort"; keep -> SGLang "retract"; wait -> rlinfer drains (see README)."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        tm = self._alive()
        assert self._gate is not None and self._idle is not None
        self._gate.clear()
        if mode is PauseMode.WAIT:
            await self._guard(self._idle.wait())
            return
        sglang_mode = "abort" if mode is PauseMode.ABORT else "retract"
        if mode is PauseMode.ABORT:
            for rid in [r for rids in self._rids.values() for r in rids]:
                self._abort_rid(rid)
        await self._guard(tm.pause_generation(PauseGenerationReqInput(mode=sglang_mode)))
        self._sglang_paused = True
        if mode is PauseMode.ABORT:
            await self._guard(self._idle.wait())

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """Resume SGLang (if it was paused) and let held-back requests start."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        tm = self._alive()
        assert self._gate is not None
        if self._sglang_paused:
            await self._guard(tm.continue_generation(ContinueGenerationReqInput()))
            self._sglang_paused = False
        self._gate.set()

    # --- weight sync ---------------------------------------------------------------------------

    @hookimpl
    def rlinfer_weight_specs(self) -> Mapping[str, TensorSpec]:
        """The checkpoint's parameter names, in the engine's dtype, with their shapes."""
        return dict(self._specs)

    async def _scheduler_op(
        self, control: dict[str, Any], tensors: Sequence[tuple[str, Any]] = (), *, flush: bool
    ) -> None:
        """Run rlinfer's scheduler-side loader once on every TP rank; raise on any failure."""
        from sglang.srt.managers import io_struct
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        from rlinfer_sglang.scheduler_side import encode_control

        tm = self._alive()
        result = self._result_dir / uuid.uuid4().hex
        pairs = [encode_control({**control, "result": str(result)}), *tensors]
        loop = asyncio.get_running_loop()
        payload = await loop.run_in_executor(None, MultiprocessingSerializer.serialize, pairs)
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload] * self._tp_size, load_format=WEIGHT_LOADER, flush_cache=flush
        )
        # SGLang >= 0.5.2x wraps tensor updates in begin/end_weight_update; 0.5.16 has neither.
        begin = getattr(io_struct, "BeginWeightUpdateReqInput", None)
        end = getattr(io_struct, "EndWeightUpdateReqInput", None)
        if begin is not None:
            ok, message = await self._guard(tm.begin_weight_update(begin(), None))
            if not ok:
                raise WeightUpdateError(f"SGLang refused to open a weight update: {message}")
        end_ok, end_message = True, ""
        try:
            ok, message = (await self._guard(tm.update_weights_from_tensor(req, None)))[:2]
        finally:
            if end is not None:
                end_ok, end_message = await self._guard(tm.end_weight_update(end(), None))
        outcomes = [self._outcome(result, rank) for rank in range(self._tp_size)]
        logger.debug("weight op %s: scheduler outcomes %s", control["op"], outcomes)
        failed = [o for o in outcomes if not o.get("ok")]
        if failed:
            partial = any(o.get("loaded") for o in failed)
            problems = tuple(str(o.get("error")) for o in failed)
            if partial:
                raise WeightUpdateError(
                    "SGLang failed while loading; the engine may hold a partial update: reload a full checkpoint",
                    problems,
                )
            raise WeightUpdateError(f"{control['op']} update rejected before loading", problems)
        if not ok and flush:
            # loaded, but the flush was refused: requests were running; flush again at reset
            self._cache_dirty = True
        elif not ok:
            raise WeightUpdateError(f"SGLang failed the update: {message}")
        elif flush:
            self._cache_dirty = False
        if not end_ok:
            raise WeightUpdateError(f"SGLang failed to finish the weight update: {end_message}")

    def _outcome(self, result: Path, rank: int) -> dict[str, Any]:
        path = Path(f"{result}.{rank}")
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._alive()
            return {"ok": False, "loaded": True, "error": f"TP rank {rank} reported no outcome"}
        finally:
            path.unlink(missing_ok=True)
        return data

    @hookimpl
    async def rlinfer_update_weights(self, update: WeightUpdate) -> None:
        """Hand the (validated) update to the scheduler, which checks all of it, then loads."""
        from rlinfer_core.transfer import ipc

        source = update.source
        cuda_buckets = ipc.pack_cuda(source.tensors) if isinstance(source, NamedTensors) else None
        if cuda_buckets is not None:
            await self._send_buckets(cuda_buckets)
        elif isinstance(source, NamedTensors):
            await self._scheduler_op({"op": "tensors"}, list(source.tensors), flush=True)
        elif isinstance(source, Buckets):
            await self._send_buckets(source.buckets)
        elif isinstance(source, CheckpointDir):
            await self._scheduler_op({"op": "disk", "path": str(Path(source.path).resolve())}, flush=True)
        elif isinstance(source, BroadcastSource):
            specs = [(s.name, s.dtype, list(s.shape)) for s in source.specs]
            await self._scheduler_op({"op": "broadcast", "group_name": self._group_name, "specs": specs}, flush=True)
        else:
            raise WeightUpdateError(f"unknown weight source {type(source).__name__}")

    async def _send_buckets(self, buckets: Sequence[Bucket]) -> None:
        manifests = [attrs.asdict(b.manifest) for b in buckets]
        pairs = [(str(i), b.data) for i, b in enumerate(buckets)]
        await self._scheduler_op({"op": "buckets", "manifests": manifests}, pairs, flush=True)

    _group_name = ""

    @hookimpl
    async def rlinfer_init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have every scheduler rank join the trainer's group (blocks until all ranks joined)."""
        if self.platform == "cpu" and group.backend != "gloo":
            raise InvalidRequest("backend", "SGLang on CPU joins gloo groups only")
        if group.world_size != 1 + self._tp_size:
            raise InvalidRequest(
                "world_size", f"must be 1 (trainer) + {self._tp_size} (engine ranks), got {group.world_size}"
            )
        try:
            await self._scheduler_op({"op": "join", "group": attrs.asdict(group)}, flush=False)
        except WeightUpdateError as exc:
            raise RLInferError(f"the SGLang scheduler could not join the weight group: {exc}") from exc
        self._group_name = group.group_name

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """Flush SGLang's cache; running requests are retracted (recomputed) if they hold any."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        tm = self._alive()
        if not self._cache_dirty:
            return
        if (await self._guard(tm.flush_cache())).success:
            self._cache_dirty = False
            return
        if self._sglang_paused or self._memory_paused:
            raise RLInferError("SGLang refused to flush its cache while paused")
        await self._guard(tm.pause_generation(PauseGenerationReqInput(mode="retract")))
        try:
            flushed = (await self._guard(tm.flush_cache())).success
        finally:
            await self._guard(tm.continue_generation(ContinueGenerationReqInput()))
        if not flushed:
            raise RLInferError("SGLang refused to flush its cache")
        self._cache_dirty = False

    # --- memory --------------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_release_memory(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: SGLang's memory saver. CPU: UnsupportedCapability (SGLang frees nothing there).

        SGLang requires an idle scheduler: in-flight requests are aborted and SGLang stays
        paused (new requests wait) until every released tag is resumed.
        """
        from sglang.srt.managers.io_struct import PauseGenerationReqInput, ReleaseMemoryOccupationReqInput

        self._caps.require(Capability.MEMORY_RELEASE)
        tm = self._alive()
        await self.rlinfer_abort(None)
        if not self._sglang_paused and not self._memory_paused:
            await self._guard(tm.pause_generation(PauseGenerationReqInput(mode="abort")))
            self._memory_paused = True
        assert self._idle is not None
        await self._guard(self._idle.wait())
        await self._guard(
            tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=sorted(t.value for t in tags)), None)
        )
        self._released |= tags

    @hookimpl
    async def rlinfer_resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """GPU: re-allocate what release freed (weights come back from the host backup)."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, ResumeMemoryOccupationReqInput

        self._caps.require(Capability.MEMORY_RELEASE)
        tm = self._alive()
        await self._guard(
            tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=sorted(t.value for t in tags)), None)
        )
        self._released -= tags
        if MemoryTag.KV_CACHE in tags:
            self._cache_dirty = True
            await self.rlinfer_reset_prefix_cache()
        if self._memory_paused and not self._released:
            await self._guard(tm.continue_generation(ContinueGenerationReqInput()))
            self._memory_paused = False

    # --- benchmarking --------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch in one native ``Engine.async_generate`` call with hand-built params."""
        self._alive()
        assert self._engine is not None
        input_ids: list[list[int]] = []
        params: list[dict[str, Any]] = []
        top: list[int] = []
        for r in requests:
            s = r.sampling
            for _ in range(s.n):
                input_ids.append(list(r.prompt_token_ids or ()))
                p: dict[str, Any] = {
                    "temperature": s.temperature,
                    "top_p": s.top_p,
                    "top_k": s.top_k,
                    "max_new_tokens": s.max_tokens,
                    "min_new_tokens": s.min_tokens,
                    "ignore_eos": s.ignore_eos,
                }
                if s.stop_token_ids:
                    p["stop_token_ids"] = list(s.stop_token_ids)
                if s.stop:
                    p["stop"] = list(s.stop)
                params.append(p)
                top.append(s.logprobs)
        if not input_ids:
            return 0
        outs = await self._guard(
            self._engine.async_generate(
                input_ids=input_ids, sampling_params=params, return_logprob=True, top_logprobs_num=top
            )
        )
        return sum(len(o["output_ids"]) for o in outs)

    @hookimpl
    async def rlinfer_bench_raw_weight_update(self, path: str) -> None:
        """SGLang's own ``update_weights_from_disk``, no rlinfer validation."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        tm = self._alive()
        ok, message, *_ = await self._guard(
            tm.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=str(Path(path).resolve())), None)
        )
        if not ok:
            raise WeightUpdateError(f"SGLang update_weights_from_disk failed: {message}")
        self._cache_dirty = False


__all__ = ["SGLangBackend", "create"]
