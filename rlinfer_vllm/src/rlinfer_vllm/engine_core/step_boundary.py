"""A weight load between two engine steps, run by the engine core itself.

Runs in vLLM's engine-core process: :func:`register` is a vLLM general plugin (entry point
``rlinfer_step_boundary`` in ``vllm.general_plugins``, loaded by every ``EngineCore`` at start),
which gives ``EngineCoreProc`` the utility method :data:`UTILITY` (:func:`call_at_step_boundary`).

Why: an update must not overlap an engine step, so that every token is computed wholly by the old
or wholly by the new weights (:mod:`rlinfer_vllm.versions`). Driven from the client, that is a
pause in "keep" mode, the load, and a resume: three round trips through the client's event loop,
which under 128 streams is busy decoding outputs, so generation stood still for tens of
milliseconds per update. Here the engine core does the same in one utility call:

1. the scheduler is paused in "keep" mode (``PauseState.PAUSED_ALL``: no new step is scheduled,
   KV caches are kept);
2. once no step is in flight (vLLM's own idle callbacks, as its ``pause_scheduler`` waits; at
   once when none is), the worker method runs on every worker (``collective_rpc("rlinfer_call")``);
3. the weights' epoch is counted up and every request that has not started is salted with it
   (:func:`salt_with_epoch`), the encoder cache reset on request;
4. the scheduler resumes, and the reply goes out before the outputs of any later step.

The engine core answers utility calls and step outputs over one socket in the order it made them,
so on the client the reply marks exactly where the new version starts
(:meth:`rlinfer_vllm.versions.TokenVersions.switch_on`).

Prefixes: a request's first block is hashed with its ``cache_salt`` (the client's version salt,
:mod:`rlinfer_vllm.versions`), which the client chose when it admitted the request, not when the
engine core got it. Requests keep arriving during a load (the client holds none back), so the
engine core salts by what it knows: every request it adds after the first load carries the
*weight epoch* (loads so far) in its salt, and at each load the requests still waiting without a
computed token are re-salted with the new epoch. A block is then only ever read by requests that
compute with the weights that wrote it, and no load resets the prefix cache (a reset preempts
every running request). Requests already running keep their KV, as they do across any load.

:data:`BESIDE_STEPS` runs a worker method in a thread of the engine-core process, on its own CUDA
stream, while the engine keeps stepping: staging and checksums, which only read the live weights.
That needs the worker in this process (vLLM's ``UniProcExecutor``, one GPU); elsewhere it is
``collective_rpc`` between two steps.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

#: the utility's name on ``EngineCoreProc`` (the client calls it by name)
UTILITY = "rlinfer_call_at_step_boundary"
#: a utility answering True: the client's check that the plugin was loaded
READY = "rlinfer_step_boundary_ready"
#: the utility that runs a worker method beside the engine's steps (:func:`call_beside_steps`)
BESIDE_STEPS = "rlinfer_call_beside_steps"
#: the engine core's attribute counting the loads made at its step boundary
EPOCH = "_rlinfer_weight_epoch"


def register() -> None:
    """The vLLM general plugin: add :data:`UTILITY`, :data:`BESIDE_STEPS` and :data:`READY` to
    ``EngineCoreProc``, and salt requests it adds after a load with the weight epoch."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    setattr(EngineCoreProc, UTILITY, call_at_step_boundary)
    setattr(EngineCoreProc, BESIDE_STEPS, call_beside_steps)
    setattr(EngineCoreProc, READY, ready)
    if not getattr(EngineCore.add_request, "_rlinfer_salts_epoch", False):
        EngineCore.add_request = _salting_epoch(EngineCore.add_request)


def _salting_epoch(add_request: Any) -> Any:
    """``EngineCore.add_request`` that first salts the request with the weight epoch (none
    before the first load: an engine rlinfer never loaded into hashes as vLLM does)."""

    def add(engine: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        epoch = getattr(engine, EPOCH, 0)
        if epoch:
            salt_with_epoch(request, epoch)
        return add_request(engine, request, *args, **kwargs)

    add._rlinfer_salts_epoch = True  # type: ignore[attr-defined]
    return add


def salt_with_epoch(request: Any, epoch: int) -> None:
    """Salt ``request`` (a ``vllm.v1.request.Request`` with no computed token) with the weight
    ``epoch`` on top of its own salt, and hash its prompt's blocks again with it."""
    base = getattr(request, "_rlinfer_base_salt", None)
    if base is None:
        base = request._rlinfer_base_salt = request.cache_salt or ""
    request.cache_salt = f"{base}#w{epoch}"
    request.block_hashes = []  # the hasher continues from the blocks hashed so far: all again
    request.update_block_hashes()


def ready(engine: Any) -> bool:
    """The :data:`READY` utility."""
    return True


def call_at_step_boundary(
    engine: Any, method: str, args: Sequence[Any], timeout_s: float | None, reset_encoder_cache: bool
) -> Any:
    """``engine``'s utility (see the module docstring): every worker's outcome of
    ``RLInferWorkerExtension.<method>(*args)`` (:mod:`rlinfer_vllm.ranks`), whether every rank
    loaded, how many waiting requests were salted with the new epoch, and how long the load
    waited for the step in flight and took, as ``{"outcomes": [...], "loaded": bool, "resalted":
    int, "timings": {"step_wait_s", "boundary_load_s", "load_start_t", "load_end_t"}}`` (``_t``:
    ``time.monotonic``, the clock of vLLM's output stamps); a ``concurrent.futures.Future`` of it
    while a step is still in flight (vLLM replies when it completes)."""
    import time
    from concurrent.futures import Future

    from vllm.v1.core.sched.interface import PauseState

    scheduler = engine.scheduler
    if scheduler.pause_state != PauseState.UNPAUSED:
        raise RuntimeError("the scheduler is paused already: the load needs no step boundary")
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    called = time.perf_counter()

    def load() -> dict[str, Any]:
        started = time.perf_counter()
        try:
            with weights_lock(engine):  # a checksum beside the steps finishes first
                outcomes = engine.collective_rpc("rlinfer_call", timeout=timeout_s, args=(method, *args))
            loaded = all(outcome["ok"] for outcome in outcomes)  # rlinfer_vllm.ranks
            resalted = 0
            if loaded:
                epoch = getattr(engine, EPOCH, 0) + 1
                setattr(engine, EPOCH, epoch)
                for request in waiting_requests(scheduler):
                    if not_started(request):
                        salt_with_epoch(request, epoch)
                        resalted += 1
                if reset_encoder_cache:
                    engine.reset_encoder_cache()
            ended = time.perf_counter()
            # the load's place on the clock of the engine core's output stamps (time.monotonic)
            at = {"load_start_t": time.monotonic() - (ended - started), "load_end_t": time.monotonic()}
            timings = {"step_wait_s": started - called, "boundary_load_s": ended - started, **at}
            return {"outcomes": outcomes, "loaded": loaded, "resalted": resalted, "timings": timings}
        finally:
            scheduler.set_pause_state(PauseState.UNPAUSED)

    if not engine.has_work():
        return load()
    reply: Future[dict[str, Any]] = Future()

    def when_idle(engine: Any) -> None:
        try:
            reply.set_result(load())
        except BaseException as exc:  # the client gets it as the utility's failure
            reply.set_exception(exc)
        # The busy loop called this while idle and is about to block on its input queue; the
        # resumed requests are work again: vLLM's wake-up sentinel sends it back to stepping.
        from vllm.v1.engine import EngineCoreRequestType

        engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    engine._idle_state_callbacks.append(when_idle)
    return reply


def waiting_requests(scheduler: Any) -> list[Any]:
    """Requests waiting to be scheduled (new or preempted): they look up the prefix cache then."""
    return [*scheduler.waiting, *getattr(scheduler, "skipped_waiting", ())]


def not_started(request: Any) -> bool:
    """Whether ``request`` has computed nothing yet: it will prefill with the new weights, so it
    must not read blocks the old ones computed. (A preempted request with tokens finds its own old
    blocks: the KV a running request keeps across a load anyway.)"""
    return int(request.num_output_tokens) == 0 and int(request.num_computed_tokens) == 0


def call_beside_steps(engine: Any, method: str, args: Sequence[Any], timeout_s: float | None) -> Any:
    """``engine``'s :data:`BESIDE_STEPS` utility: every worker's outcome of
    ``RLInferWorkerExtension.rlinfer_on_side_stream(method, *args)``; a
    ``concurrent.futures.Future`` of it when the worker lives in this process (the call runs in
    the engine core's one background thread while it keeps stepping), else the outcomes of
    ``collective_rpc`` between two steps. For methods that do not write the live weights."""
    call_args = ("rlinfer_on_side_stream", method, *args)
    executor = engine.model_executor
    if type(executor).__name__ != "UniProcExecutor":
        return engine.collective_rpc("rlinfer_call", timeout=timeout_s, args=call_args)
    from concurrent.futures import ThreadPoolExecutor

    background = getattr(engine, "_rlinfer_background", None)
    if background is None:
        background = engine._rlinfer_background = ThreadPoolExecutor(1, thread_name_prefix="rlinfer-beside-steps")
    lock = weights_lock(engine)

    def call() -> Any:
        with lock:
            return executor.collective_rpc("rlinfer_call", timeout=timeout_s, args=call_args)

    return background.submit(call)


def weights_lock(engine: Any) -> threading.Lock:
    """The lock a load at the step boundary and a call beside the steps hold: a checksum never
    reads weights halfway through a load."""
    lock: threading.Lock | None = getattr(engine, "_rlinfer_weights_lock", None)
    if lock is None:
        lock = engine._rlinfer_weights_lock = threading.Lock()
    return lock


__all__ = ["BESIDE_STEPS", "READY", "UTILITY", "call_at_step_boundary", "call_beside_steps", "register"]
