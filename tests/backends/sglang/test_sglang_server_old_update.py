"""Server mode's path for an SGLang without ``/begin_weight_update`` (0.5.16, the GPU bundle).

The feature is found by asking the server (a GET that SGLang's POST-only route refuses with 405,
an unknown route is 404). CPU CI has SGLang 0.5.23, whose scheduler loads tensor updates only
inside begin/end, so these tests drive the 0.5.16 update *semantics* (the transport's ``flush_needs_idle``, set
from the detection on 0.5.16) against a real 0.5.23 server, begin/end still sent: an update with
requests running waits for them (every token keeps the old version, nothing is retracted), the
cache is flushed through /flush_cache before new requests start, a rejected update leaves the old
weights serving, and a reset while requests run waits for them. Skipping begin/end itself is
to be exercised on the GPU (SGLang 0.5.16: dev/gpu/run_suite.sh bench-server; not run yet).

Runs only with ``RLINFER_SGLANG_SERVER_TESTS=1`` (``make test-sglang-server``): an SGLang server
start takes about a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_server_helpers import FIELDS as BASE_FIELDS
from sglang_server_helpers import PROMPTS, SERVER_TESTS

from rlinfer_core.engine import AsyncEngine
from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.types import Capability, EngineConfig, GenerateRequest, SamplingParams
from rlinfer_core.weights import CheckpointDir

pytest.importorskip("sglang")
pytestmark = SERVER_TESTS

FIELDS: dict[str, Any] = BASE_FIELDS | {"mode": "server"}
LONG = 400  # tokens per sample of the batch that runs during an update


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("sglang-old-update")
    return make_tiny_model(base / "seed0", seed=0), make_tiny_model(base / "seed1", seed=1)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path], loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    config = EngineConfig(model=str(models[0]), **FIELDS)
    opened = loop.run_until_complete(AsyncEngine.open("sglang", config, load_entry_point_plugins=False))
    try:
        yield opened
    finally:
        loop.run_until_complete(opened.shutdown())


def _batch(max_tokens: int) -> list[GenerateRequest]:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [GenerateRequest(prompt_token_ids=p, sampling=sampling) for p in PROMPTS]


async def _running(backend: Any) -> None:
    """Until SGLang's scheduler holds requests (its own load report; bounded)."""
    deadline = time.monotonic() + 60
    while True:
        _, report = await backend._transport._http.request("GET", "/v1/loads", params={"include": "core"})
        held = sum(int(d.get("num_running_reqs", 0)) + int(d.get("num_waiting_reqs", 0)) for d in report["loads"])
        if backend._flight.active and held:
            return
        assert time.monotonic() < deadline, "the batch never reached the scheduler"
        await asyncio.sleep(0.005)


def test_the_server_is_asked_for_begin_weight_update(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    from rlinfer_sglang.transport.http import has_begin_end

    http = engine._backend._transport._http

    async def go() -> tuple[int, int, bool]:
        known, _ = await http.request("GET", "/begin_weight_update")
        unknown, _ = await http.request("GET", "/begin_weight_update_not_a_route")
        return known, unknown, await has_begin_end(http)

    known, unknown, found = loop.run_until_complete(go())
    assert (known, unknown) == (405, 404), "the probe's premise: POST-only route 405, no route 404"
    assert found and engine._backend._transport.begin_end and not engine._backend._transport.flush_needs_idle
    assert engine.capabilities.supports(Capability.PAUSE_KEEP)


def test_capabilities_without_begin_end_drop_pause_keep(engine: Any) -> None:
    from rlinfer_sglang.transport.http_capabilities import server_capabilities

    backend = engine._backend
    info = {"disable_overlap_schedule": True, "enable_deterministic_inference": False}
    caps = server_capabilities(backend._caps, info, backend._transport._http.url, True, False, begin_end=False)
    assert not caps.supports(Capability.PAUSE_KEEP)
    assert "0.5.16" in caps.notes[Capability.PAUSE_KEEP.value]


def test_update_waits_for_running_requests_then_flushes(
    engine: Any, models: tuple[Path, Path], loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    backend = engine._backend
    backend._transport.flush_needs_idle = True
    try:

        async def go() -> tuple[list[Any], list[Any], list[Any]]:
            before = await engine.generate(_batch(8))
            gen = asyncio.ensure_future(engine.generate(_batch(LONG)))
            await _running(backend)
            await engine.update_weights(CheckpointDir(str(models[1])))
            assert gen.done(), "the update returned while its batch still ran"
            out = await gen
            assert not backend._flight.cache_dirty, "the cache was flushed after the idle load"
            after = await engine.generate(_batch(8))
            return before, out, after

        before, out, after = loop.run_until_complete(go())
        for c in out:
            assert len(c.token_ids) == LONG, "nothing was aborted or cut"
            assert set(c.token_versions) == {0}, "every token came from the old weights"
        assert all(set(c.token_versions) == {1} for c in after)
        assert [c.token_ids for c in after] != [c.token_ids for c in before], "the new weights serve"

        # a rejected update (a wrong shape, found where the scheduler reads the files) loads nothing
        from rlinfer_core.transfer.disk import read_tensors, save_dir

        tensors = [(n, t.clone()) for n, t in read_tensors(models[0])]
        name, first = tensors[0]
        tensors[0] = (name, first.new_zeros((first.shape[0] + 1, *first.shape[1:])))
        bad = save_dir(tensors, tmp_path / "bad")

        async def rejected() -> list[Any]:
            with pytest.raises(WeightUpdateError):
                await engine.update_weights(CheckpointDir(str(bad)))
            return await engine.generate(_batch(8))

        again = loop.run_until_complete(rejected())
        assert [c.token_ids for c in again] == [c.token_ids for c in after], "the old weights keep serving"
        assert all(set(c.token_versions) == {1} for c in again)
    finally:
        loop.run_until_complete(engine.update_weights(CheckpointDir(str(models[0]))))
        backend._transport.flush_needs_idle = False


def test_reset_while_requests_run_waits_for_them(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    backend = engine._backend
    backend._transport.flush_needs_idle = True
    try:

        async def go() -> list[Any]:
            gen = asyncio.ensure_future(engine.generate(_batch(LONG)))
            await _running(backend)
            backend._flight.cache_dirty = True
            await engine.reset_prefix_cache()
            assert gen.done(), "the flush ran while requests were pending"
            assert not backend._flight.cache_dirty
            return await gen

        out = loop.run_until_complete(go())
        assert all(len(c.token_ids) == LONG for c in out)
    finally:
        backend._transport.flush_needs_idle = False
