"""The HTTP transport: vLLM's own API server (``vllm serve``), launched here or attached to.

``EngineConfig(mode="server")`` launches the server as a child process
(:class:`rlinfer_core.server_child.ChildServer`, command line from
:mod:`rlinfer_vllm.transport.server_command`); ``EngineConfig(server_url=...)`` attaches to a
running one, started with ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --enable-scale-out
--logprobs-mode processed_logprobs --max-logprobs 21 --worker-extension-cls
rlinfer_vllm.worker.RLInferWorkerExtension`` (vLLM 0.26: without ``--enable-scale-out``, which it
lacks, and with ``--middleware rlinfer_vllm.api_server.batch_route.BatchRoute``, which answers in
place of 0.32's token endpoint features; see :mod:`rlinfer_vllm.api_server.engine_route`).
Everything then goes over HTTP with the engine's own endpoints (see the README's "Server mode");
worker calls through ``/collective_rpc`` into the same worker extension as in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlinfer_core.errors import BackendLoadError, EngineDead, InvalidRequest, RLInferError, UnsupportedCapability
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.server_child import ChildServer
from rlinfer_core.tools import ToolCalls, ToolSpec
from rlinfer_core.types import (
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    PauseMode,
)
from rlinfer_core.weights import TensorSpec
from rlinfer_vllm import engine_io, token_endpoint
from rlinfer_vllm.api_server.batch_route import PATH as BATCH_PATH
from rlinfer_vllm.api_server.engine_route import FEATURES_PATH, VERSION_PATH
from rlinfer_vllm.batch import complete_all
from rlinfer_vllm.capabilities import SERVER_MODE_NOTE, Platform, capabilities
from rlinfer_vllm.config import engine_args, engine_variables
from rlinfer_vllm.transport import ProcessWatch, Started, process_roles
from rlinfer_vllm.transport.http_client import RouteMissing, ServerClient, b64
from rlinfer_vllm.transport.server_capabilities import server_capabilities
from rlinfer_vllm.transport.server_command import server_argv, server_process, with_port
from rlinfer_vllm.transport.stream_versions import StreamVersions
from rlinfer_vllm.versions import cache_salt, salt_nonce

#: a stream's token versions where vLLM's token endpoint reports no weight-version spans
STREAM_026_NOTE = (
    "vLLM 0.26 server: a stream's deltas read after a weight update are stamped with the new version "
    "(0.26's token endpoint reports no per-token version spans; batch generate is exact)"
)
#: tries at binding a free port (another process may take it between the probe and the bind)
PORT_TRIES = 3


class HttpTransport:
    """The engine calls over one vLLM server, launched here or attached to."""

    gated = False
    multimodal = False

    def __init__(self, config: EngineConfig, platform: Platform, engine_version: str, inflight: set[str]) -> None:
        self.config = config
        self.platform = platform
        self._inflight = inflight
        self.capabilities = capabilities(platform, engine_version, config.enable_memory_release)
        self._server: ChildServer | None = None
        self._http: ServerClient | None = None
        self._closed = False
        self._info: ModelInfo | None = None
        #: whether the server has rlinfer's batch endpoint (False after a 404: attached server)
        self._batch_route = True
        #: what the server's vLLM offers (``GET /rlinfer/v1/features``, see engine_route.features)
        self._features: dict[str, Any] = {}
        #: the weight version live on the server (also its weight-version label)
        self.version = 0
        #: the version the engine may compute with now, and how many switches were resumed
        #: (see :mod:`rlinfer_vllm.transport.stream_versions`)
        self.serving_version = 0
        self.switches = 0
        self._salt_nonce = salt_nonce()
        self._dead_processes = ProcessWatch(lambda: [] if self._server is None else self._server.dead())

    @property
    def kv_cache_release(self) -> bool:
        """Whether the server has ``/release_kv_cache_memory`` (vLLM 0.26 lacks it)."""
        return bool(self._features.get("release_kv_cache_memory", True))

    @property
    def salted(self) -> bool:
        """Whether the server's token endpoint takes ``cache_salt`` (rlinfer's middleware says so;
        an attached server without it: not known, so not relied on)."""
        return bool(self._features.get("cache_salt", False))

    #: loads pause and resume the scheduler through the server (its version labels live in the
    #: server process: rlinfer_vllm.transport.stream_versions)
    loads_at_step_boundary = False

    async def rpc_at_step_boundary(self, method: str, *args: Any, version: int) -> Any:
        """Not offered by this transport (:attr:`loads_at_step_boundary` is False)."""
        raise NotImplementedError("loads at the engine core's step boundary run in process only")

    def prefill_pending(self) -> bool:
        """Whether a request of this backend is in flight: the server does not say whether it
        prefilled (each request's salt is read in the same step as it is counted in flight)."""
        return bool(self._inflight)

    async def settle_prefills(self, timeout_s: float) -> None:
        """Returns at once: the server does not say when a request's prefill ended."""

    def _salt(self) -> str | None:
        """The salt of the version now labelled (:mod:`rlinfer_vllm.versions`), where the server salts."""
        return cache_salt(self._salt_nonce, self.version) if self.salted else None

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> Started:
        """Launch ``vllm serve`` (or attach to ``server_url``), wait for /health, read the model's
        facts and parameter specs from the worker, and label the weights version 0."""
        config = self.config
        url = await self._launch(config) if config.server_url is None else config.server_url.rstrip("/")
        self._http = ServerClient(url, config.request_timeout_s, self._dead_processes if self._server else None)
        if config.server_url is not None and not await self._http.healthy():
            await self._http.aclose()
            raise BackendLoadError(f"no healthy vLLM server at {url} (GET /health)")
        try:
            facts = await self._http.rpc("rlinfer_server_facts")
            # dtype="auto": updates come in the checkpoint's dtypes (see the in-process transport)
            rows = await self._http.rpc("rlinfer_attach", config.dtype == "auto")
            self._features = await self._server_features(self._http)
            await self.label_version(self.version)
        except RLInferError as exc:
            await self.shutdown()
            raise BackendLoadError(
                f"the vLLM server at {url} does not serve rlinfer's control endpoints ({exc}); start it with "
                "VLLM_SERVER_DEV_MODE=1, --enable-scale-out (vLLM 0.32) and "
                "--worker-extension-cls rlinfer_vllm.worker.RLInferWorkerExtension; on vLLM 0.26 also with "
                "--middleware rlinfer_vllm.api_server.batch_route.BatchRoute"
            ) from exc
        specs = {name: TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in rows}
        tied = {}
        if facts["tie_word_embeddings"] and "lm_head.weight" not in specs:
            tied["lm_head.weight"] = "model.embed_tokens.weight"
        self._info = ModelInfo(
            vocab_size=facts["vocab_size"],
            max_model_len=facts["max_model_len"],
            eos_token_ids=tuple(facts["eos_token_ids"]),
            tied_weights=tied,
        )
        if facts["device"] != self.platform:
            await self.shutdown()
            raise BackendLoadError(f"the vLLM server runs on {facts['device']!r}, expected {self.platform!r}")
        caps = server_capabilities(self.capabilities, facts, url, launched=self._server is not None)
        if not self._features.get("token_version_spans", True):
            caps = attrs.evolve(caps, notes={**caps.notes, Capability.STREAM.value: STREAM_026_NOTE})
        self.capabilities = caps
        return Started(specs, self._info, caps)

    async def _server_features(self, http: ServerClient) -> dict[str, Any]:
        """What the server's vLLM offers (rlinfer's middleware reports it; an attached server
        without the middleware is taken for a vLLM 0.32 one, whose token endpoint rlinfer reads)."""
        try:
            return dict(await http.get_optional(FEATURES_PATH))
        except RouteMissing:
            return {"batch_via_engine": False, "token_version_spans": True, "release_kv_cache_memory": True}

    async def _launch(self, config: EngineConfig) -> str:
        import httpx

        from rlinfer_core.server_child import launch

        kwargs = engine_args(config, self.platform)
        argv = await asyncio.get_running_loop().run_in_executor(None, server_argv, kwargs, "127.0.0.1", 0)
        env = engine_variables(config, self.platform)

        def make(port: int) -> ChildServer:
            self._server = server_process(with_port(argv, port), env)
            return self._server

        async with httpx.AsyncClient() as probe:
            server = await launch(make, probe, tries=PORT_TRIES)
        return server.url

    def _alive(self) -> ServerClient:
        http = self._http
        if self._closed or http is None:
            raise EngineDead("the vLLM server backend is shut down; open a new engine")
        http.check_processes()
        return http

    def check_alive(self) -> None:
        """EngineDead when a launched server's process died, or the transport was shut down."""
        self._alive()

    async def check_health(self) -> None:
        """EngineDead when /health does not answer 200."""
        http = self._alive()
        if not await http.healthy():
            raise EngineDead(f"the vLLM server at {http.url} is not healthy; open a new engine")

    async def shutdown(self) -> None:
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

    def processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the launched server's processes (``APIServer``, ``EngineCore``,
        ``Worker-0``...); none for an attached server (not this engine's to manage)."""
        if self._server is None:
            return {}
        from rlinfer_core import processes

        return process_roles(processes.alive(self._server.tracked), self._server.pid)

    # --- generate ------------------------------------------------------------------------------

    async def _prompt_ids(self, http: ServerClient, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        assert request.messages is not None
        self.capabilities.require(Capability.CHAT)
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

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """The whole batch in one call to rlinfer's batch endpoint (registered with the engine in
        one pass, :mod:`rlinfer_vllm.api_server.batch_route`); on a server without it (attached,
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
        payloads = [
            token_endpoint.body(r, ids, max_len, stream=False, salt=self._salt())
            for r, ids in zip(requests, prompts, strict=True)
        ]
        results: list[list[Completion] | None] = [None] * len(requests)
        started = time.perf_counter()
        for r in requests:
            self._inflight.add(r.request_id)
        try:
            # an error on one request closes the stream, which cancels (aborts) the others, as
            # complete_all cancels the other calls on the per-request path
            async for line in http.ndjson(BATCH_PATH, {"requests": payloads}):
                i, status, answer = int(line["index"]), int(line["status"]), line["body"]
                request = requests[i]
                self._inflight.discard(request.request_id)
                if status >= 500:
                    # a fresh look at the processes: a killed engine process is EngineDead now
                    self._dead_processes.look_now()
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
        payload = token_endpoint.body(request, ids, self._max_len(), stream=False, salt=self._salt())
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
        done = token_endpoint.completions(request, ids, answer, latency_s, self.version)
        if not done:
            return engine_io.aborted_before_output(request, ids, latency_s)
        return engine_io.replicate(request, done)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Server-sent events of ``/inference/v1/generate``; each delta's tokens carry the version
        that computed them (exact: :mod:`rlinfer_vllm.transport.stream_versions`)."""
        http = self._alive()
        ids = await self._prompt_ids(http, request)
        payload = token_endpoint.body(request, ids, self._max_len(), stream=True, salt=self._salt())
        k = request.sampling.logprobs
        stamps = StreamVersions(self.switches, self.serving_version)
        self._inflight.add(request.request_id)
        try:
            async for chunk in http.stream("/inference/v1/generate", payload):
                token_endpoint.raise_stream_error(chunk)
                for choice in chunk.get("choices") or ():
                    if choice.get("finish_reason") is not None:
                        self._inflight.discard(request.request_id)
                    for ready, versions in stamps.take(choice, self.switches, self.serving_version):
                        item = token_endpoint.delta(request.request_id, ready, k, versions)
                        for copy in engine_io.replicate(request, [item]):
                            yield copy
            for ready, versions in stamps.flush(self.serving_version):
                item = token_endpoint.delta(request.request_id, ready, k, versions)
                for copy in engine_io.replicate(request, [item]):
                    yield copy
        finally:
            self._inflight.discard(request.request_id)

    # --- abort, pause, caches ------------------------------------------------------------------

    async def abort(self, request_ids: Sequence[str]) -> None:
        """``POST /abort_requests``."""
        ids = [token_endpoint.engine_request_id(i) for i in request_ids]
        await self._alive().post("/abort_requests", {"request_ids": ids})

    async def pause(self, mode: PauseMode) -> None:
        """``POST /pause?mode=...``; "keep" keeps the frozen requests' KV cache."""
        params = {"mode": mode.value, "clear_cache": str(mode != PauseMode.KEEP).lower()}
        await self._alive().post("/pause", params=params)

    async def resume(self) -> None:
        """``POST /resume``, counting a version switch first if the weights changed while paused
        (every token computed with the new weights is read after the count changed)."""
        http = self._alive()
        if self.version != self.serving_version:
            self.serving_version = self.version
            self.switches += 1
        await http.post("/resume")

    async def pause_for_load(self) -> None:
        """``/pause?mode=keep`` (vLLM answers once no step is in flight; KV caches are kept)."""
        await self._alive().post("/pause", params={"mode": "keep", "clear_cache": "false"})

    async def resume_after_load(self) -> None:
        """:meth:`resume`, shielded: a cancelled or failed load must not leave the server paused
        (a dead server raises on the next call)."""
        with contextlib.suppress(RLInferError):
            await asyncio.shield(self.resume())

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        """``POST /reset_prefix_cache``; whether it succeeded."""
        params = {"reset_running_requests": "true"} if reset_running else None
        answer = await self._alive().post("/reset_prefix_cache", params=params)
        return bool((answer or {}).get("success", False))

    async def reset_encoder_cache(self) -> None:
        """Nothing: server mode serves no images."""

    # --- weights and memory --------------------------------------------------------------------

    async def rpc(self, method: str, *args: Any) -> Any:
        """``RLInferWorkerExtension.<method>`` through the server's ``/collective_rpc`` (bytes as base64)."""
        return await self._alive().rpc(method, *(b64(a) if isinstance(a, bytes) else a for a in args))

    async def label_version(self, version: int) -> None:
        """Label the tokens of every later step with ``version``: vLLM's ``/update_weight_version``
        where vLLM reports version spans (0.32), and rlinfer's route where the batch endpoint
        counts tokens itself (vLLM 0.26)."""
        http = self._alive()
        if self._features.get("batch_via_engine"):
            await http.post(VERSION_PATH, {"new_version": str(version)})
        if self._features.get("token_version_spans", True):  # streams read vLLM's own spans
            await http.post("/update_weight_version", {"new_version": str(version)})
        self.version = version

    async def sleep(self, level: int) -> None:
        """``POST /sleep?level=...`` (requests in flight are aborted)."""
        await self._alive().post("/sleep", params={"level": level, "mode": "abort"})

    async def release_kv_cache(self) -> None:
        """Abort what runs and ``POST /release_kv_cache_memory``."""
        http = self._alive()
        await http.post("/pause", params={"mode": "abort"})
        await http.post("/release_kv_cache_memory")

    async def wake_up(self, tags: Sequence[str]) -> None:
        """``POST /wake_up?tags=...``."""
        await self._alive().post("/wake_up", params=[("tags", t) for t in tags])  # type: ignore[arg-type]

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """The same batch through the server's own ``/v1/completions`` (token-id prompts, the
        sampled tokens' logprobs), one HTTP call per request; tokens out."""
        http = self._alive()

        async def one(request: GenerateRequest) -> int:
            s = request.sampling
            body = {
                "prompt": list(request.prompt_token_ids or ()),
                "n": 1 if s.greedy else s.n,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "max_tokens": s.max_tokens,
                "min_tokens": s.min_tokens,
                "seed": s.seed,
                "ignore_eos": s.ignore_eos,
                "logprobs": s.logprobs,
                "return_token_ids": True,
            }
            answer = await http.post("/v1/completions", body, retry=False)
            copies = s.n if s.greedy else 1  # greedy n>1 is one sample, replicated
            return copies * sum(len(c.get("token_ids") or ()) for c in answer["choices"])

        return sum(await asyncio.gather(*(one(r) for r in requests)))

    async def bench_raw_weight_update(self, path: str) -> None:
        """vLLM's own reload from disk through ``/collective_rpc`` (no validation)."""
        http = self._alive()
        resolved = str(Path(path).resolve())
        body = {"method": "reload_weights", "kwargs": {"weights_path": resolved}, "timeout": http.timeout_s}
        await http.post("/collective_rpc", body, retry=False, close=True)
        await http.rpc("rlinfer_shadow_from_dir", resolved)

    # --- in process only (capabilities tools, lora: off with SERVER_MODE_NOTE) ------------------

    def parse_tool_calls(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Not in server mode."""
        raise UnsupportedCapability(Capability.TOOLS.value, "vllm", SERVER_MODE_NOTE)

    async def load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        """Not in server mode."""
        raise UnsupportedCapability(Capability.LORA.value, "vllm", SERVER_MODE_NOTE)

    async def unload_lora(self, name: str) -> None:
        """Not in server mode."""
        raise UnsupportedCapability(Capability.LORA.value, "vllm", SERVER_MODE_NOTE)

    async def list_loras(self) -> Sequence[str]:
        """Not in server mode."""
        raise UnsupportedCapability(Capability.LORA.value, "vllm", SERVER_MODE_NOTE)


__all__ = ["HttpTransport"]
