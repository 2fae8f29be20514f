"""SGLang-specific behaviour the shared kit does not cover, on one real engine (in file order):
process tracking, pause(keep) across a weight update, stop ids under ignore_eos, aborting a
request held by pause(wait), the bench hooks, then engine death and a clean shutdown."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import psutil
import torch

from rlinfer_core.engine import Engine
from rlinfer_core.errors import EngineDead
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import FinishReason, GenerateRequest, PauseMode, SamplingParams

MAX_LEN = 512
#: how long a paused-keep request must stay silent (after draining what was already produced)
PAUSED_QUIET_S = 1.0
#: children of the test process before the engine started (other engines of the session, ...)
BEFORE: set[int] = set()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sglang-models")
    return make_tiny_model(root / "a", seed=0), make_tiny_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def sibling() -> Iterator[subprocess.Popen[bytes]]:
    """A child of the test process that is not the engine's: it must survive everything."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path], sibling: subprocess.Popen[bytes]) -> Iterator[Engine]:
    BEFORE.update(p.pid for p in psutil.Process().children(recursive=True))
    eng = Engine.open("sglang", model=str(models[0]), dtype="float32", seed=0, max_model_len=MAX_LEN)
    yield eng
    eng.shutdown()


def _backend(engine: Engine) -> object:
    return engine.async_engine._backend


def _greedy(prompt: list[int], max_tokens: int, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    )


def _hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt) :]]


def _hf_greedy_over_old_kv(models: tuple[Path, Path], prompt: list[int], before: list[int], n: int) -> list[int]:
    """The second model's greedy continuation over the KV the first computed for
    ``prompt + before[:-1]`` (what an in-place pause keeps across an update)."""
    from transformers import AutoModelForCausalLM

    old, new = (AutoModelForCausalLM.from_pretrained(str(m), dtype=torch.float32) for m in models)
    out: list[int] = []
    with torch.inference_mode():
        cache = old(torch.tensor([prompt + before[:-1]]), use_cache=True).past_key_values
        last = before[-1]
        for _ in range(n):
            step = new(torch.tensor([[last]]), past_key_values=cache, use_cache=True)
            cache, last = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(last)
    return out


def test_engine_processes_are_tracked(engine: Engine) -> None:
    pids = _backend(engine).engine_processes()  # type: ignore[attr-defined]
    names = sorted(psutil.Process(p).name() for p in pids)
    assert names == ["sglang::detokenizer", "sglang::scheduler"]
    roles = engine.engine_processes()
    assert sorted(roles) == ["detokenizer", "scheduler"] and sorted(roles.values()) == sorted(pids)


@pytest.mark.parametrize("paused", [True, False], ids=["pause_keep", "unpaused"])
def test_token_versions_switch_at_the_load(engine: Engine, models: tuple[Path, Path], paused: bool) -> None:
    """pause(keep) + update + resume, or an update while the request runs: tokens before the
    load carry the old version and come from the first model; tokens after it carry the new
    version and continue with the second model (recomputing the KV after pause(keep)'s retract;
    over the kept KV after the in-place pause of an update that runs unpaused)."""
    request = _greedy([1, 23], 120, ignore_eos=True)
    old = engine.weight_version
    stream = engine.stream(request)
    before = []
    while len(before) < 8:  # premise: the request is running and has produced tokens
        delta = next(stream)
        assert delta.token_versions == (old,) * len(delta.token_ids)
        before.extend(delta.token_ids)
    if paused:
        engine.pause(PauseMode.KEEP)
        try:
            version = engine.update_weights(_disk(models[1]))
        finally:
            engine.resume()
    else:
        assert request.request_id in engine.in_flight
        version = engine.update_weights(_disk(models[1]))
        assert request.request_id in engine.in_flight, "premise: the update landed mid-request"
    rest = list(stream)
    tokens = before + [t for d in rest for t in d.token_ids]
    versions = [old] * len(before) + [v for d in rest for v in (d.token_versions or ())]
    assert len(tokens) == len(versions) == 120
    switch = versions.index(version)
    assert set(versions[:switch]) == {old} and set(versions[switch:]) == {version}
    assert switch >= len(before), "tokens streamed before the pause keep the old version"
    assert tokens[:switch] == _hf_greedy(models[0], [1, 23], switch), "old tokens: the first model"
    if not paused and _backend(engine)._transport.update_pause == "in_place":  # type: ignore[attr-defined]
        after = _hf_greedy_over_old_kv(models, [1, 23], tokens[:switch], 120 - switch)
    else:
        after = _hf_greedy(models[1], [1, 23, *tokens[:switch]], 120 - switch)
    assert tokens[switch:] == after, "then the second"
    engine.update_weights(_disk(models[0]))  # the other tests start from the first model


def _disk(path: Path) -> object:
    from rlinfer_core.weights import CheckpointDir

    return CheckpointDir(str(path))


def _drain_until_quiet(pool: concurrent.futures.ThreadPoolExecutor, stream: Iterator[Any], into: list[Any]) -> Any:
    """Take the deltas already on their way; return the pending ``next`` once none came for
    PAUSED_QUIET_S (bounded: an unpaused stream would keep delivering until it finished)."""
    pending = pool.submit(next, stream)
    while True:
        try:
            delta = pending.result(timeout=PAUSED_QUIET_S)
        except concurrent.futures.TimeoutError:
            return pending
        assert delta.finish_reason is None, "pause(keep) must freeze the request, not end it"
        into.append(delta)
        pending = pool.submit(next, stream)


def test_pause_keep_survives_a_weight_update(engine: Engine, models: tuple[Path, Path]) -> None:
    """Two requests frozen by pause(keep) across a named-tensor update: no token while paused,
    then each continues from where it stopped, every later token under the new weights."""
    from transformers import AutoModelForCausalLM

    old = engine.weight_version
    max_tokens = 120
    requests = [_greedy([1, 20 + i], max_tokens, ignore_eos=True) for i in range(2)]
    new = dict(AutoModelForCausalLM.from_pretrained(str(models[1]), dtype=torch.float32).named_parameters())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [engine.stream(r) for r in requests]
        deltas: list[list[Any]] = [[pool.submit(next, s).result(timeout=120)] for s in streams]
        assert {r.request_id for r in requests} <= engine.in_flight, "premise: both requests are running"
        engine.pause(PauseMode.KEEP)
        try:
            pending = [_drain_until_quiet(pool, s, d) for s, d in zip(streams, deltas, strict=True)]
            frozen_at = [sum(len(d.token_ids) for d in ds) for ds in deltas]
            assert all(n < max_tokens for n in frozen_at), "pause(keep) froze the requests before their end"
            version = engine.update_weights(new)
            assert not any(p.done() for p in pending), "no token while paused, across the update"
            assert {r.request_id for r in requests} <= engine.in_flight, "kept requests stay in flight"
        finally:
            engine.resume()
        for p, s, ds in zip(pending, streams, deltas, strict=True):
            ds.append(p.result(timeout=120))
            ds.extend(s)
    assert version == engine.weight_version == old + 1
    for request, ds, n in zip(requests, deltas, frozen_at, strict=True):
        tokens = [t for d in ds for t in d.token_ids]
        versions = [v for d in ds for v in (d.token_versions or ())]
        assert len(tokens) == len(versions) == max_tokens and ds[-1].finish_reason is FinishReason.LENGTH
        assert versions == [old] * n + [version] * (max_tokens - n), "the switch is where the request froze"
        prompt = list(request.prompt_token_ids or ())
        assert tokens[:n] == _hf_greedy(models[0], prompt, n), "frozen tokens: the first model"
        assert tokens[n:] == _hf_greedy(models[1], prompt + tokens[:n], max_tokens - n), "then the second"
    engine.update_weights(_disk(models[0]))  # the other tests start from the first model


def test_stop_id_under_ignore_eos_batch_and_stream(engine: Engine) -> None:
    (full,) = engine.generate(_greedy([1, 9, 10], 16, ignore_eos=True))
    tokens = list(full.token_ids)
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    request = _greedy([1, 9, 10], 16, ignore_eos=True, stop_token_ids=(tokens[k],))
    (stopped,) = engine.generate(request)
    assert list(stopped.token_ids) == tokens[: k + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == (FinishReason.STOP, tokens[k])
    deltas = list(engine.stream(request))
    assert [t for d in deltas for t in d.token_ids] == tokens[: k + 1]
    assert deltas[-1].finish_reason is FinishReason.STOP


def test_abort_a_request_held_by_pause_wait(engine: Engine) -> None:
    engine.pause(PauseMode.WAIT)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            request = _greedy([1, 30], 50)
            future = pool.submit(engine.generate, [request])
            admission = engine.async_engine._requests.admission
            deadline = time.monotonic() + 30
            while request.request_id not in admission.waiting and time.monotonic() < deadline:
                time.sleep(0.01)
            assert request.request_id in admission.waiting, "pause(wait) holds new requests at the gate"
            assert request.request_id not in engine.in_flight and not future.done()
            engine.abort([request.request_id])
            (c,) = future.result(timeout=30)
        finally:
            engine.resume()
    assert c.finish_reason is FinishReason.ABORT and c.token_ids == ()
    assert len(engine.generate(_greedy([1, 30], 4))[0].token_ids) == 4, "the request id is usable again"


def test_bench_hooks(engine: Engine, models: tuple[Path, Path]) -> None:
    requests = [_greedy([1, 40 + i], 8, ignore_eos=True) for i in range(4)]
    assert engine.bench_raw_generate(requests) == 32
    engine.bench_raw_weight_update(str(models[0]))
    prompt = [1, 5, 6, 7]
    (c,) = engine.generate(_greedy(prompt, 8, ignore_eos=True))
    assert list(c.token_ids) == _hf_greedy(models[0], prompt, 8)


def _hf_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens).unsqueeze(-1))
    return [float(x) for x in picked.squeeze(-1)]


def test_reset_prefix_cache_drops_stale_kv(engine: Engine, models: tuple[Path, Path]) -> None:
    """The kit cannot tell a no-op reset on SGLang (its own disk reload flushes the cache): here
    the second model is loaded by the scheduler-side loader without a flush, so the cached prefix
    is stale until reset_prefix_cache() drops it."""
    backend: Any = _backend(engine)
    prompt = [1, *((37 * j) % 300 + 16 for j in range(300))]
    engine.generate(_greedy(prompt, 6, ignore_eos=True))  # the prompt's KV (first model) is now cached
    engine._run(backend._weights.scheduler_op({"op": "disk", "path": str(models[1].resolve())}, flush=False))

    def gap_to_second_model() -> tuple[list[int], float]:
        (c,) = engine.generate(_greedy(prompt, 6, ignore_eos=True))
        tokens = list(c.token_ids)
        want = _hf_logprobs(models[1], prompt, tokens)
        return tokens, max(abs(a - b) for a, b in zip(c.logprobs, want, strict=True))

    _, stale = gap_to_second_model()
    assert stale > 1e-3, "premise: the cache served the first model's KV after the unflushed load"
    engine.reset_prefix_cache()
    tokens, fresh = gap_to_second_model()
    assert fresh < 1e-4, f"after reset_prefix_cache the KV is still stale (max |dlogprob| {fresh:.2e})"
    assert tokens == _hf_greedy(models[1], prompt, 6)
    engine.update_weights(_disk(models[0]))  # the other tests start from the first model


def test_scheduler_death_raises_engine_dead(engine: Engine, sibling: subprocess.Popen[bytes]) -> None:
    backend = _backend(engine)
    scheduler = next(p for p in backend.engine_processes() if psutil.Process(p).name() == "sglang::scheduler")  # type: ignore[attr-defined]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(engine.generate, [_greedy([1, 50], MAX_LEN - 8, ignore_eos=True)])
        time.sleep(0.3)
        killed = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        with pytest.raises(EngineDead):
            future.result(timeout=30)
        assert time.monotonic() - killed < 5.0, "death is noticed within seconds"
    with pytest.raises(EngineDead):
        engine.check_health()
    with pytest.raises(EngineDead):
        engine.generate(_greedy([1, 2], 2))
    deadline = time.monotonic() + 10
    while backend.engine_processes() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.2)
    assert backend.engine_processes() == [], "the rest of the engine is killed: no orphans"  # type: ignore[attr-defined]
    assert sibling.poll() is None, "the caller and its other children survive"


def test_shutdown_leaves_no_child_processes(engine: Engine, sibling: subprocess.Popen[bytes]) -> None:
    all_pids = _backend(engine)._transport._supervision.all_engine_processes()  # type: ignore[attr-defined]
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in all_pids)
    children = [p for p in psutil.Process().children(recursive=True) if p.pid not in BEFORE]
    left = {
        p.pid: (p.status(), p.cmdline()[:4])
        for p in children
        if p.status() == psutil.STATUS_ZOMBIE or "resource_tracker" not in " ".join(p.cmdline())
    }
    assert left == {}
    assert sibling.poll() is None, "shutdown kills only the engine's processes"
