"""The vLLM backend in server mode: rlinfer's operation hooks over a real ``vllm serve`` process.

``EngineConfig(mode="server")`` launches the server (:mod:`rlinfer_vllm.server_mode.launch`);
``EngineConfig(server_url=...)`` attaches to a running one, started with
``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --enable-scale-out --logprobs-mode processed_logprobs
--max-logprobs 21 --worker-extension-cls rlinfer_vllm.worker.RLInferWorkerExtension`` (vLLM 0.26:
without ``--enable-scale-out``, which it lacks, and with ``--middleware
rlinfer_vllm.server_mode.batch_route.BatchRoute``, which answers in place of 0.32's token endpoint
features; see :mod:`rlinfer_vllm.server_mode.engine_route`).
Everything then goes over HTTP with the engine's own endpoints (see the README's "Server mode").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.errors import BackendLoadError, EngineDead, InvalidRequest, RLInferError
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
from rlinfer_core.weights import TensorSpec
from rlinfer_vllm import convert as inproc_convert
from rlinfer_vllm.batch import complete_all
from rlinfer_vllm.capabilities import capabilities, installed_engine, installed_platform
from rlinfer_vllm.config import engine_args, engine_variables, resolve_platform
from rlinfer_vllm.server_mode import convert
from rlinfer_vllm.server_mode.batch_route import PATH as BATCH_PATH
from rlinfer_vllm.server_mode.caps import server_capabilities
from rlinfer_vllm.server_mode.engine_route import FEATURES_PATH
from rlinfer_vllm.server_mode.http import RouteMissing, ServerClient
from rlinfer_vllm.server_mode.launch import ServerProcess, free_port, server_argv
from rlinfer_vllm.server_mode.memory import ServerMemoryHooks
from rlinfer_vllm.server_mode.stream import StreamVersions
from rlinfer_vllm.server_mode.weights import ServerWeightHooks
from rlinfer_vllm.staging import ServerStagingHooks

#: how long abort() keeps re-aborting requests that the server had not registered yet
ABORT_SETTLE_S = 2.0
#: how often calls look for exited server processes
PROCESS_CHECK_S = 0.2
#: a stream's token versions where vLLM's token endpoint reports no weight-version spans
STREAM_026_NOTE = (
    "vLLM 0.26 server: a stream's deltas read after a weight update are stamped with the new version "
    "(0.26's token endpoint reports no per-token version spans; batch generate is exact)"
)
#: tries at binding a free port (another process may take it between the probe and the bind)
PORT_TRIES = 3


class VllmServerBackend(ServerWeightHooks, ServerStagingHooks, ServerMemoryHooks):
    """rlinfer's hooks for one vLLM server, launched here or attached to."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config, installed_platform())
        found = installed_engine()
        self.engine_version = f"{found[0]} {found[1]}" if found else "not installed"
        self._caps = capabilities(self.platform, self.engine_version, config.enable_memory_release)
        self._server: ServerProcess | None = None
        self._http: ServerClient | None = None
        self._closed = False
        self._specs: dict[str, TensorSpec] = {}
        self._info: ModelInfo | None = None
        self._inflight: set[str] = set()
        #: whether the server has rlinfer's batch endpoint (False after a 404: attached server)
        self._batch_route = True
        self._features: dict[str, Any] = {}
        self._asleep: set[MemoryTag] = set()
        self._implicitly_asleep: set[MemoryTag] = set()
        #: the weight version live on the server (also its weight-version label)
        self.version = 0
        #: the version the engine may compute with now, and how many switches were resumed
        #: (see :mod:`rlinfer_vllm.server_mode.stream`)
        self.serving_version = 0
        self.switches = 0
        self._dead_pids: list[int] = []
        self._procs_checked_at = 0.0
        self._pause_lock = asyncio.Lock()
        self._user_pause: PauseMode | None = None
        self.start_seconds: float | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Launch ``vllm serve`` (or attach to ``server_url``), wait for /health, read the model's
        facts and parameter specs from the worker, and label the weights version 0."""
        started = time.perf_counter()
        if config.server_url is None:
            url = await self._launch(config)
        else:
            url = config.server_url.rstrip("/")
        self._http = ServerClient(url, config.request_timeout_s, self._dead_processes if self._server else None)
        if config.server_url is not None and not await self._http.healthy():
            await self._http.aclose()
            raise BackendLoadError(f"no healthy vLLM server at {url} (GET /health)")
        try:
            facts = await self._http.rpc("rlinfer_server_facts")
            # dtype="auto": updates come in the checkpoint's dtypes (see the in-process backend)
            specs = await self._http.rpc("rlinfer_attach", config.dtype == "auto")
            self._features = await self._server_features(self._http)
            await self._label_version(self._http, self.version)
        except RLInferError as exc:
            await self.rlinfer_shutdown()
            raise BackendLoadError(
                f"the vLLM server at {url} does not serve rlinfer's control endpoints ({exc}); start it with "
                "VLLM_SERVER_DEV_MODE=1, --enable-scale-out (vLLM 0.32) and "
                "--worker-extension-cls rlinfer_vllm.worker.RLInferWorkerExtension; on vLLM 0.26 also with "
                "--middleware rlinfer_vllm.server_mode.batch_route.BatchRoute"
            ) from exc
        self._specs = {name: TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in specs}
        tied = {}
        if facts["tie_word_embeddings"] and "lm_head.weight" not in self._specs:
            tied["lm_head.weight"] = "model.embed_tokens.weight"
        self._info = ModelInfo(
            vocab_size=facts["vocab_size"],
            max_model_len=facts["max_model_len"],
            eos_token_ids=tuple(facts["eos_token_ids"]),
            tied_weights=tied,
        )
        if facts["device"] != self.platform:
            await self.rlinfer_shutdown()
            raise BackendLoadError(f"the vLLM server runs on {facts['device']!r}, expected {self.platform!r}")
        self._caps = server_capabilities(self._caps, facts, url, launched=self._server is not None)
        if not self._features.get("token_version_spans", True):
            self._caps = attrs.evolve(self._caps, notes={**self._caps.notes, Capability.STREAM.value: STREAM_026_NOTE})
        self.start_seconds = time.perf_counter() - started

    async def _server_features(self, http: ServerClient) -> dict[str, Any]:
        """What the server's vLLM offers (rlinfer's middleware reports it; an attached server
        without the middleware is taken for a vLLM 0.32 one, whose token endpoint rlinfer reads)."""
        try:
            return dict(await http.get_optional(FEATURES_PATH))
        except RouteMissing:
            return {"batch_via_engine": False, "token_version_spans": True, "release_kv_cache_memory": True}

    async def _launch(self, config: EngineConfig) -> str:
        import httpx

        kwargs = engine_args(config, self.platform)
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient() as probe:
            for attempt in range(PORT_TRIES):
                port = free_port()
                argv = await loop.run_in_executor(None, server_argv, kwargs, "127.0.0.1", port)
                server = ServerProcess(argv, engine_variables(config, self.platform))
                self._server = server
                server.start(port)
                try:
                    await server.wait_healthy(probe)
                    return server.url
                except BackendLoadError as exc:
                    await loop.run_in_executor(None, server.stop)
                    if "address already in use" not in str(exc).lower() or attempt == PORT_TRIES - 1:
                        raise
                except BaseException:  # cancelled by the startup timeout
                    await asyncio.shield(loop.run_in_executor(None, server.stop))
                    raise
        raise AssertionError("unreachable")

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        """Capabilities of this server (refined at start)."""
        return self._caps

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        """Vocabulary size, context length and EOS ids of the served model."""
        if self._info is None:
            raise EngineDead("the vLLM server backend is not started")
        return self._info

    @hookimpl
    async def rlinfer_check_health(self) -> None:
        """EngineDead when a server process died or /health does not answer 200."""
        http = self._alive()
        if not await http.healthy():
            raise EngineDead(f"the vLLM server at {http.url} is not healthy; open a new engine")

    def _alive(self) -> ServerClient:
        http = self._http
        if self._closed or http is None:
            raise EngineDead("the vLLM server backend is shut down; open a new engine")
        http.check_processes()
        return http

    def _dead_processes(self) -> list[int]:
        """Pids of the launched server's processes that exited (looked up at most every
        PROCESS_CHECK_S unless one was found dead)."""
        now = time.monotonic()
        if self._server is not None and (now - self._procs_checked_at >= PROCESS_CHECK_S or self._dead_pids):
            self._dead_pids = self._server.dead()
            self._procs_checked_at = now
        return self._dead_pids

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
        """Stop a launched server and every process it started; an attached server keeps running."""
        if self._closed:
            return
        self._closed = True
        http, self._http = self._http, None
        if http is not None:
            with contextlib.suppress(Exception):
                await http.aclose()
        server, self._server = self._server, None
        if server is not None:
            await asyncio.get_running_loop().run_in_executor(None, server.stop)

    @hookimpl
    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the launched server's processes (``APIServer``, ``EngineCore``,
        ``Worker-0``...); none for an attached server (not this engine's to manage)."""
        return {} if self._server is None else self._server.roles()

    # --- generate ------------------------------------------------------------------------------

    async def _prompt_ids(self, http: ServerClient, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        assert request.messages is not None
        self._caps.require(Capability.CHAT)
        answer = await http.post(
            "/tokenize",
            {
                "messages": [{"role": m.role, "content": m.content} for m in request.messages],
                "add_generation_prompt": True,
                "add_special_tokens": False,
            },
        )
        ids = list(answer["tokens"])
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

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """The whole batch in one call to rlinfer's batch endpoint (registered with the engine in
        one pass, :mod:`rlinfer_vllm.server_mode.batch_route`); on a server without it (attached,
        404) every request concurrently, one ``/inference/v1/generate`` call each. n completions
        per request, in request order."""
        http = self._alive()
        if self._batch_route and requests:
            try:
                return await self._generate_batch(http, requests)
            except RouteMissing:
                self._batch_route = False
        return await complete_all(requests, self._complete)

    async def _generate_batch(self, http: ServerClient, requests: Sequence[GenerateRequest]) -> list[Completion]:
        prompts = await asyncio.gather(*(self._prompt_ids(http, r) for r in requests))
        max_len = self._max_len()
        payloads = [convert.body(r, ids, max_len, stream=False) for r, ids in zip(requests, prompts, strict=True)]
        results: list[list[Completion] | None] = [None] * len(requests)
        started = time.perf_counter()
        self._inflight.update(r.request_id for r in requests)
        try:
            # an error on one request closes the stream, which cancels (aborts) the others, as
            # complete_all cancels the other calls on the per-request path
            async for line in http.ndjson(BATCH_PATH, {"requests": payloads}):
                i, status, answer = int(line["index"]), int(line["status"]), line["body"]
                request = requests[i]
                self._inflight.discard(request.request_id)
                if status >= 500:
                    # a fresh look at the processes: a killed engine process is EngineDead now
                    self._procs_checked_at = 0.0
                    http.check_processes()
                if status >= 300:
                    raise await http.error("/inference/v1/generate", status, answer)
                results[i] = self._finish(request, prompts[i], answer, time.perf_counter() - started)
        finally:
            for r in requests:
                self._inflight.discard(r.request_id)
        missing = [r.request_id for r, done in zip(requests, results, strict=True) if done is None]
        if missing:
            http.check_processes()
            raise EngineDead(f"the vLLM server's {BATCH_PATH} answer ended without requests {missing[:5]}")
        return [c for group in results if group is not None for c in group]

    async def _complete(self, request: GenerateRequest) -> list[Completion]:
        http = self._alive()
        ids = await self._prompt_ids(http, request)
        payload = convert.body(request, ids, self._max_len(), stream=False)
        started = time.perf_counter()
        self._inflight.add(request.request_id)
        try:
            answer = await http.post("/inference/v1/generate", payload, retry=False)
        finally:
            self._inflight.discard(request.request_id)
        return self._finish(request, ids, answer, time.perf_counter() - started)

    def _finish(
        self, request: GenerateRequest, ids: list[int], answer: Mapping[str, Any], latency_s: float
    ) -> list[Completion]:
        """The request's completions from the token endpoint's answer (replicated for greedy n)."""
        done = convert.completions(request, ids, answer, latency_s, self.version)
        if not done:
            return inproc_convert.aborted_before_output(request, ids, latency_s)
        return inproc_convert.replicate(request, done)

    @hookimpl
    async def rlinfer_generate_stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Server-sent events of ``/inference/v1/generate``; each delta's tokens carry the version
        that computed them (exact: :mod:`rlinfer_vllm.server_mode.stream`)."""
        http = self._alive()
        ids = await self._prompt_ids(http, request)
        payload = convert.body(request, ids, self._max_len(), stream=True)
        k = request.sampling.logprobs
        stamps = StreamVersions(self.switches, self.serving_version)
        self._inflight.add(request.request_id)
        try:
            async for chunk in http.stream("/inference/v1/generate", payload):
                convert.raise_stream_error(chunk)
                for choice in chunk.get("choices") or ():
                    if choice.get("finish_reason") is not None:
                        self._inflight.discard(request.request_id)
                    for ready, versions in stamps.take(choice, self.switches, self.serving_version):
                        item = convert.delta(request.request_id, ready, k, versions)
                        for copy in inproc_convert.replicate(request, [item]):
                            yield copy
            for ready, versions in stamps.flush(self.serving_version):
                item = convert.delta(request.request_id, ready, k, versions)
                for copy in inproc_convert.replicate(request, [item]):
                    yield copy
        finally:
            self._inflight.discard(request.request_id)

    @hookimpl
    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort requests (None: every request of this engine in flight) through /abort_requests;
        their callers get "abort" with the tokens so far."""
        http = self._alive()
        ids = list(self._inflight) if request_ids is None else list(request_ids)
        if not ids:
            return
        await http.post("/abort_requests", {"request_ids": [convert.engine_request_id(i) for i in ids]})
        # a request whose HTTP call is on its way is not registered in vLLM yet; abort again
        # until every one of them has ended (bounded)
        deadline = time.monotonic() + ABORT_SETTLE_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            left = [i for i in ids if i in self._inflight]
            if not left:
                return
            await http.post("/abort_requests", {"request_ids": [convert.engine_request_id(i) for i in left]})

    @hookimpl
    async def rlinfer_pause(self, mode: PauseMode) -> None:
        """``POST /pause?mode=...``; "keep" keeps the frozen requests' KV cache."""
        http = self._alive()
        async with self._pause_lock:
            await http.post("/pause", params={"mode": mode.value, "clear_cache": str(mode != PauseMode.KEEP).lower()})
            self._user_pause = mode

    @hookimpl
    async def rlinfer_resume(self) -> None:
        """``POST /resume``."""
        http = self._alive()
        async with self._pause_lock:
            await self._send_resume(http)
            self._user_pause = None

    async def _send_resume(self, http: ServerClient) -> None:
        """``POST /resume``, counting a version switch first if the weights changed while paused
        (every token computed with the new weights is read after the count changed)."""
        if self.version != self.serving_version:
            self.serving_version = self.version
            self.switches += 1
        await http.post("/resume")

    @hookimpl
    async def rlinfer_reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``; if blocks are held, again with running requests reset."""
        http = self._alive()
        answer = await http.post("/reset_prefix_cache")
        if not (answer or {}).get("success", False):
            await http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})


def evolve_caps(caps: Capabilities, drop: Mapping[Capability, str]) -> Capabilities:
    """``caps`` without ``drop``'s capabilities, each noted with its reason."""
    notes = {**caps.notes, **{c.value: why for c, why in drop.items()}}
    return attrs.evolve(caps, supported=caps.supported - set(drop), notes=notes)


__all__ = ["VllmServerBackend", "evolve_caps"]
