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
3. the prefix cache is reset if a request waits without a token (it was salted with the old
   version, :mod:`rlinfer_vllm.versions`, and would read old blocks), the encoder cache on request;
4. the scheduler resumes, and the reply goes out before the outputs of any later step.

The engine core answers utility calls and step outputs over one socket in the order it made them,
so on the client the reply marks exactly where the new version starts
(:meth:`rlinfer_vllm.versions.TokenVersions.switch_on`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: the utility's name on ``EngineCoreProc`` (the client calls it by name)
UTILITY = "rlinfer_call_at_step_boundary"
#: a utility answering True: the client's check that the plugin was loaded
READY = "rlinfer_step_boundary_ready"


def register() -> None:
    """The vLLM general plugin: add :data:`UTILITY` and :data:`READY` to ``EngineCoreProc``."""
    from vllm.v1.engine.core import EngineCoreProc

    setattr(EngineCoreProc, UTILITY, call_at_step_boundary)
    setattr(EngineCoreProc, READY, ready)


def ready(engine: Any) -> bool:
    """The :data:`READY` utility."""
    return True


def call_at_step_boundary(
    engine: Any, method: str, args: Sequence[Any], timeout_s: float | None, reset_encoder_cache: bool
) -> Any:
    """``engine``'s utility (see the module docstring): every worker's outcome of
    ``RLInferWorkerExtension.<method>(*args)`` (:mod:`rlinfer_vllm.ranks`), whether every rank
    loaded, whether the prefix cache was reset, and how long the load waited for the step in
    flight and took, as ``{"outcomes": [...], "loaded": bool, "prefix_cache_reset": bool,
    "timings": {"step_wait_s", "boundary_load_s", "load_start_t", "load_end_t"}}`` (``_t``:
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
            outcomes = engine.collective_rpc("rlinfer_call", timeout=timeout_s, args=(method, *args))
            loaded = all(outcome["ok"] for outcome in outcomes)  # rlinfer_vllm.ranks
            reset = loaded and any(not_started(request) for request in waiting_requests(scheduler))
            if reset and not engine.reset_prefix_cache():  # running requests hold blocks: recompute them
                engine.reset_prefix_cache(reset_running_requests=True)
            if loaded and reset_encoder_cache:
                engine.reset_encoder_cache()
            took = time.perf_counter() - started
            now = time.monotonic()  # the clock of the engine core's output stamps
            timings = {
                "step_wait_s": started - called,
                "boundary_load_s": took,
                "load_start_t": now - took,
                "load_end_t": now,
            }
            return {"outcomes": outcomes, "loaded": loaded, "prefix_cache_reset": reset, "timings": timings}
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
    """Whether ``request`` has no token yet: admitted under the old version's salt, it would
    prefill with the new weights and could read blocks the old ones computed. (A preempted request
    with tokens finds its own old blocks: the KV a running request keeps across a load anyway.)"""
    return int(request.num_output_tokens) == 0


__all__ = ["READY", "UTILITY", "call_at_step_boundary", "register"]
