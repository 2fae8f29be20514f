"""The HTTP transport: SGLang's own HTTP server, launched here or attached to by URL.

``EngineConfig(mode="server")`` launches ``python -m sglang.launch_server`` as a child process
(:mod:`rlinfer_sglang.transport.launch`, :class:`rlinfer_core.server_child.ChildServer`);
``EngineConfig(server_url=...)`` attaches to a running one (same host: started with the options
in the README's "Server mode"). Every engine call is one of SGLang's endpoints (see the README's
endpoint table). Weight payloads travel base64 in the JSON body of ``/update_weights_from_tensor``,
tensors as shared-memory / CUDA-IPC handles (:func:`rlinfer_core.transfer.ipc.dumps`); the
scheduler-side loader writes its outcome to a file on this host, so weights need the same host.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from typing_extensions import override

from rlinfer_core.errors import BackendLoadError, EngineDead, InvalidRequest, RLInferError
from rlinfer_core.server_child import HOST, ChildServer, launch
from rlinfer_core.server_http import ServerClient, ServerError
from rlinfer_core.types import Capabilities, Capability, EngineConfig
from rlinfer_sglang.capabilities import Platform, amx_repacks
from rlinfer_sglang.config import WEIGHT_LOADER, server_args
from rlinfer_sglang.requests import label, priority_sign
from rlinfer_sglang.transport import Served, Transport
from rlinfer_sglang.transport.http_capabilities import (
    SERVER_QUANTIZED_RELOAD_NOTE,
    SERVER_ROUTES_NOTE,
    server_capabilities,
)
from rlinfer_sglang.transport.launch import SERVER_ROLE, make_server, role_of, server_argv, server_env

T = TypeVar("T")

#: how often calls look for exited server processes
PROCESS_CHECK_S = 0.2
#: the liveness probe: answered by the HTTP server and SGLang's tokenizer manager at once, also
#: while generation is paused (SGLang's /health generates a token: it takes >= 1 s and hangs while
#: paused); a dead scheduler is seen from the launched server's processes, and an attached
#: server's own watchdog stops it when its scheduler dies
LIVENESS_PATH = "/model_info"


async def has_begin_end(http: ServerClient) -> bool:
    """Whether the server has ``/begin_weight_update`` (SGLang >= 0.5.2x): asked without side
    effects, as a GET that the POST-only route refuses with 405; 404 means it has no such route."""
    status, _ = await http.request("GET", "/begin_weight_update")
    return status != 404


class HttpTransport(Transport):
    """SGLang's HTTP server (``EngineConfig(mode="server")`` or ``EngineConfig(server_url=...)``)."""

    #: a request whose HTTP call has not reached the server yet is unknown to SGLang (it ignores
    #: the abort), so abort repeats until every aborted request has ended (bounded)
    abort_settle_s = 2.0
    off_before_start: Mapping[Capability, str] = {
        Capability.GENERATE_ROUTED_EXPERTS: SERVER_ROUTES_NOTE,
        Capability.WEIGHTS_QUANTIZED_RELOAD: SERVER_QUANTIZED_RELOAD_NOTE,  # refused before start
    }

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self.tp_size = config.world_size
        self.begin_end = True
        self.flush_needs_idle = False
        # not over HTTP: a request posted before an update may reach the server's scheduler after
        # the load (nothing tells this client when it did), and would match what older weights
        # cached under its older key; updates flush the cache as before
        self.salts = False
        self.update_pause = "retract"
        self._server: ChildServer | None = None
        self._http: ServerClient | None = None
        self._closed = False
        self._background: set[asyncio.Task[Any]] = set()
        self._dead_pids: list[int] = []
        self._procs_checked_at = 0.0

    # --- lifecycle -----------------------------------------------------------------------------

    @override
    async def start(self, capabilities: Capabilities) -> Served:
        """Launch the server (or attach to ``server_url``), wait for /health, read what it serves,
        and label the weights version 0."""
        config = self.config
        url = await self._launch(config) if config.server_url is None else config.server_url.rstrip("/")
        dead = self._dead_processes if self._server else None
        self._http = ServerClient(url, config.request_timeout_s, "SGLang", dead, LIVENESS_PATH)
        try:
            return await self._attach(config, url, capabilities)
        except BaseException:
            await self.shutdown()
            raise

    async def _launch(self, config: EngineConfig) -> str:
        import httpx

        from rlinfer_sglang.transport.supervision import ensure_cpu_env

        ensure_cpu_env(self.platform)  # the parser below imports SGLang, which reads it at import
        kwargs = server_args(config, self.platform)
        env = server_env(config, self.platform)
        # checked once off the loop (the parser imports SGLang); then each port's argv is quick
        await asyncio.get_running_loop().run_in_executor(None, server_argv, kwargs, HOST, 0)

        def make(port: int) -> Any:
            self._server = make_server(server_argv(kwargs, HOST, port), env)
            return self._server

        async with httpx.AsyncClient() as probe:
            server = await launch(make, probe)
        return server.url

    async def _attach(self, config: EngineConfig, url: str, capabilities: Capabilities) -> Served:
        http = self._client()
        if config.server_url is not None and not await http.healthy():
            raise BackendLoadError(f"no healthy SGLang server at {url} (GET /health)")
        try:
            info = await http.get("/server_info")
        except RLInferError as exc:
            raise BackendLoadError(f"the server at {url} does not answer SGLang's /server_info: {exc}") from exc
        missing = []
        if WEIGHT_LOADER not in (info.get("custom_weight_loader") or ()):
            missing.append(f"--custom-weight-loader {WEIGHT_LOADER}")
        if not info.get("enable_custom_logit_processor"):
            missing.append("--enable-custom-logit-processor")
        if missing:
            raise BackendLoadError(f"the SGLang server at {url} was not started with {' '.join(missing)}")
        if info.get("device") != self.platform:
            raise BackendLoadError(f"the SGLang server runs on {info.get('device')!r}, expected {self.platform!r}")
        self.tp_size = int(info.get("tp_size") or 1)
        tokenizer = await asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)
        models = await http.get("/v1/models")  # the resolved context length (server_info: as given)
        context = next((m.get("max_model_len") for m in models.get("data") or () if m.get("max_model_len")), None)
        context = context or info.get("context_length")
        if not isinstance(context, int):
            raise BackendLoadError(f"the SGLang server reports no context length (/v1/models): {context!r}")
        ok, message = await self.label(0)
        if not ok:
            raise BackendLoadError(f"the SGLang server refused its weight-version label: {message}")
        self.begin_end = await has_begin_end(http)
        self.flush_needs_idle = not self.begin_end
        chat = getattr(tokenizer, "chat_template", None) is not None
        caps = server_capabilities(capabilities, info, url, chat, amx_repacks(), begin_end=self.begin_end)
        from rlinfer_sglang.config import _hf_config

        cfg = _hf_config(config.model) or {}
        if "vocab_size" not in cfg:
            raise BackendLoadError(f"cannot read the vocabulary size of {config.model!r} (config.json)")
        limit = info.get("max_req_input_len")
        return Served(
            capabilities=caps,
            context_len=context,
            max_req_input_len=limit if isinstance(limit, int) else None,
            vocab_size=int(cfg["vocab_size"]),
            eos_token_ids=frozenset(self._eos(cfg, tokenizer)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            served_dtype=None if config.dtype == "auto" else str(info.get("dtype") or config.dtype),
            model_dir=config.model,
            tokenizer=tokenizer,
            priority_sign=priority_sign(info),
        )

    def _eos(self, cfg: Mapping[str, Any], tokenizer: Any) -> set[int]:
        eos: set[int] = set()
        generation: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            generation = json.loads((Path(self.config.model) / "generation_config.json").read_text())
        for found in (cfg.get("eos_token_id"), generation.get("eos_token_id")):
            eos |= {found} if isinstance(found, int) else set(found or ())
        return eos

    def _load_tokenizer(self) -> Any:
        """The model's tokenizer, loaded as SGLang loads it (None when it cannot be loaded here)."""
        try:
            from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

            return get_tokenizer(self.config.tokenizer or self.config.model)
        except Exception:
            return None

    def _client(self) -> ServerClient:
        assert self._http is not None
        return self._http

    @override
    def alive(self) -> None:
        http = self._http
        if self._closed or http is None:
            raise EngineDead("the SGLang server backend is shut down; open a new engine")
        http.check_processes()

    def _alive(self) -> ServerClient:
        self.alive()
        return self._client()

    @override
    async def guard(self, awaitable: Awaitable[T]) -> T:
        return await awaitable  # a dead server is seen by every HTTP call (the client's process check)

    @override
    def translate(self, exc: Exception) -> Exception:
        return exc

    @override
    async def check_health(self) -> None:
        """EngineDead when a server process died or the server does not answer (LIVENESS_PATH)."""
        http = self._alive()
        if not await http.healthy():
            raise EngineDead(f"the SGLang server at {http.url} is not healthy; open a new engine")

    def _dead_processes(self) -> list[int]:
        """Pids of the launched server's processes that exited (looked up at most every
        PROCESS_CHECK_S unless one was found dead)."""
        now = time.monotonic()
        if self._server is not None and (now - self._procs_checked_at >= PROCESS_CHECK_S or self._dead_pids):
            self._dead_pids = self._server.dead()
            self._procs_checked_at = now
        return self._dead_pids

    @override
    async def shutdown(self) -> None:
        """Stop a launched server and every process it started; an attached server keeps running."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._background):
            task.cancel()
        http, self._http = self._http, None
        if http is not None:
            with contextlib.suppress(Exception):
                await http.aclose()
        server, self._server = self._server, None
        if server is not None:
            await asyncio.get_running_loop().run_in_executor(None, server.stop)

    @override
    def processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the launched server's processes (``server``, ``scheduler``,
        ``detokenizer``); none for an attached server (not this engine's to manage)."""
        return {} if self._server is None else self._server.roles(SERVER_ROLE, role_of)

    # --- generation ----------------------------------------------------------------------------

    @override
    async def generate(self, body: Mapping[str, Any]) -> Any:
        return await self._alive().post("/generate", dict(body))

    @override
    async def stream(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for out in self._alive().stream("/generate", dict(body)):
            if "error" in out:
                raise _stream_error(out["error"])
            yield out

    @override
    async def abort(self, rids: Sequence[str]) -> None:
        http = self._alive()
        await asyncio.gather(*(http.post("/abort_request", {"rid": rid}) for rid in rids))

    @override
    def abort_soon(self, rids: Sequence[str]) -> None:
        if not rids or self._closed:
            return

        async def quiet() -> None:  # fire and forget; errors are dropped
            with contextlib.suppress(Exception):
                await self.abort(list(rids))

        task = asyncio.ensure_future(quiet())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @override
    async def pause(self, mode: str) -> None:
        await self._alive().post("/pause_generation", {"mode": mode})

    @override
    async def unpause(self) -> None:
        await self._alive().post("/continue_generation", {})

    @override
    async def flush(self, wait_s: float = 0.0) -> bool:
        http = self._alive()
        if wait_s > 0:
            params = {"timeout": wait_s}
            status, _ = await http.request("POST", "/flush_cache", params=params, timeout_s=wait_s + 10)
        else:
            status, _ = await http.request("POST", "/flush_cache")
        return status == 200

    @override
    async def release_memory(self, tags: list[str]) -> None:
        await self._alive().post("/release_memory_occupation", {"tags": tags})

    @override
    async def resume_memory(self, tags: list[str]) -> None:
        await self._alive().post("/resume_memory_occupation", {"tags": tags})

    # --- weights -------------------------------------------------------------------------------

    async def _control(self, path: str, body: Any) -> tuple[bool, str]:
        """SGLang's ``{"success", "message"}`` control endpoints (400 = the operation failed)."""
        status, answer = await self._alive().request("POST", path, body)
        answer = answer if isinstance(answer, Mapping) else {"message": str(answer)}
        if status == 422:  # pydantic: a malformed body (a bug here, or another SGLang version)
            raise ServerError("SGLang", path, status, str(answer))
        return bool(answer.get("success", status < 300)), str(answer.get("message", ""))

    @override
    async def serialize(self, pairs: list[tuple[str, Any]]) -> list[Any]:
        from rlinfer_core.transfer import ipc

        # file_system handles (names): the scheduler is no child of this process, so it cannot
        # fetch file descriptors from it (multiprocessing's resource sharer checks the authkey)
        payload = await asyncio.get_running_loop().run_in_executor(None, ipc.dumps, pairs)
        # one payload serves every TP rank: shared-memory names open any number of times,
        # unlike file descriptors (tests/backends/sglang/test_sglang_tp2_cpu.py, TP=2)
        return [base64.b64encode(payload).decode("ascii")] * self.tp_size

    @override
    async def begin_update(self) -> tuple[bool, str]:
        return await self._control("/begin_weight_update", {})

    @override
    async def update_tensors(
        self, payloads: list[Any], flush: bool, before_send: Callable[[], None] | None
    ) -> tuple[bool, str]:
        body = {
            "serialized_named_tensors": payloads,
            "load_format": WEIGHT_LOADER,
            "flush_cache": flush,
            "abort_all_requests": False,
        }
        if before_send is not None:
            before_send()
        return await self._control("/update_weights_from_tensor", body)

    @override
    async def end_update(self) -> tuple[bool, str]:
        return await asyncio.shield(self._control("/end_weight_update", {}))

    @override
    async def label(self, version: int) -> tuple[bool, str]:
        # SGLang records every live request's output length at the change and reports exact spans
        # per token (rlinfer_sglang.outputs.expand_versions)
        return await self._control(
            "/update_weight_version", {"new_version": label(version), "abort_all_requests": False}
        )

    @override
    def dispatched(self, rids: Sequence[str], received: Mapping[str, int]) -> set[str]:
        return {r for r in rids if received.get(r, 0) > 0}

    @override
    def unsent(self, rids: Sequence[str]) -> list[str]:
        raise NotImplementedError("the HTTP transport does not salt (salts is False)")

    @override
    async def update_from_disk(self, path: str) -> tuple[bool, str]:
        # a checkpoint on disk holds real weights, also on a server started with load_format=dummy
        return await self._control(
            "/update_weights_from_disk", {"model_path": path, "flush_cache": False, "load_format": "auto"}
        )

    @override
    async def raw_generate(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        outs = await self._alive().post("/generate", dict(body))
        return outs if isinstance(outs, list) else [outs]

    # --- LoRA (not claimed in server mode: the capability is off with its note) ---------------------

    @override
    async def load_lora(self, name: str, path: str) -> tuple[bool, str]:
        return await self._control("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    @override
    async def unload_lora(self, name: str) -> tuple[bool, str]:
        return await self._control("/unload_lora_adapter", {"lora_name": name})

    @override
    def lora_names(self) -> set[str]:
        return set()


def _stream_error(error: Any) -> Exception:
    """An error SGLang reported inside a stream (``data: {"error": ...}``)."""
    message = error.get("message", error) if isinstance(error, dict) else error
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and 400 <= code < 500:
        return InvalidRequest("request", f"the SGLang server refused the stream: {message}")
    return RLInferError(f"the SGLang server failed the stream: {message}")
