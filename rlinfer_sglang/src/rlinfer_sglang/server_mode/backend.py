"""The SGLang backend in server mode: rlinfer's operation hooks over SGLang's real HTTP server.

``EngineConfig(mode="server")`` launches ``python -m sglang.launch_server`` as a child process
(:mod:`rlinfer_sglang.server_mode.launch`); ``EngineConfig(server_url=...)`` attaches to a running
one (same host: started with the options in the README's "Server mode"). Everything then goes
over HTTP with SGLang's own endpoints (see the README's endpoint table).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlinfer_core.errors import BackendLoadError, EngineDead, RLInferError
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.server_child import HOST, launch
from rlinfer_core.server_http import ServerClient
from rlinfer_core.types import Capabilities, Capability, EngineConfig
from rlinfer_sglang.agent import AgentHooks
from rlinfer_sglang.capabilities import capabilities, installed_platform, installed_version, multimodal_off
from rlinfer_sglang.config import WEIGHT_LOADER, resolve_platform, server_args
from rlinfer_sglang.oom import kv_capacity_tokens
from rlinfer_sglang.server_mode import convert as wire
from rlinfer_sglang.server_mode.caps import SERVER_QUANTIZED_RELOAD_NOTE, SERVER_ROUTES_NOTE, server_capabilities
from rlinfer_sglang.server_mode.generation import Generation
from rlinfer_sglang.server_mode.launch import SERVER_ROLE, make_server, role_of, server_argv, server_env
from rlinfer_sglang.server_mode.memory import ServerMemory
from rlinfer_sglang.server_mode.weights import has_begin_end
from rlinfer_sglang.versions import TokenVersions

#: how often calls look for exited server processes
PROCESS_CHECK_S = 0.2
#: the liveness probe: answered by the HTTP server and SGLang's tokenizer manager at once, also
#: while generation is paused (SGLang's /health generates a token: it takes >= 1 s and hangs while
#: paused); a dead scheduler is seen from the launched server's processes, and an attached
#: server's own watchdog stops it when its scheduler dies
LIVENESS_PATH = "/model_info"


class SGLangServerBackend(ServerMemory, Generation, AgentHooks):
    """rlinfer's hooks for one SGLang server, launched here or attached to."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config, installed_platform())
        version = installed_version()
        self.engine_version = f"sglang {version}" if version else "not installed"
        self._caps = capabilities(
            self.platform,
            self.engine_version,
            config.enable_memory_release if self.platform == "cuda" else None,
            config.world_size,
        ).without(
            {
                Capability.GENERATE_ROUTED_EXPERTS: SERVER_ROUTES_NOTE,
                Capability.WEIGHTS_QUANTIZED_RELOAD: SERVER_QUANTIZED_RELOAD_NOTE,  # refused before start
            }
        )
        self._server = None
        self._http = None
        self._closed = False
        self._info = None
        self._specs = {}
        self._tp_size = config.world_size  # SGLang's tp_size: every rank of the engine
        self._tokenizer = None
        self._rids = {}
        self._aborted = set()
        self._received = {}
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self._scoring = 0
        self._sglang_paused = False
        self._memory_paused = False
        self._released = set()
        self._cache_dirty = True
        self._result_dir = Path(tempfile.mkdtemp(prefix="rlinfer-sglang-server-"))
        self._group_name = ""
        self._processor_str = ""
        self._versions = TokenVersions()
        self._pause_lock = asyncio.Lock()
        self._background = set()
        self._begin_end = True
        self._flush_needs_idle = False
        self._priority_sign = None  # set at start, from /server_info
        self._dead_pids: list[int] = []
        self._procs_checked_at = 0.0
        self.start_seconds: float | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    @hookimpl
    async def rlinfer_start(self, config: EngineConfig) -> None:
        """Launch the server (or attach to ``server_url``), wait for /health, read what it serves,
        and label the weights version 0."""
        started = time.perf_counter()
        url = await self._launch(config) if config.server_url is None else config.server_url.rstrip("/")
        dead = self._dead_processes if self._server else None
        self._http = ServerClient(url, config.request_timeout_s, "SGLang", dead, LIVENESS_PATH)
        try:
            await self._attach(config, url)
        except BaseException:
            await self.rlinfer_shutdown()
            raise
        self.start_seconds = time.perf_counter() - started

    async def _launch(self, config: EngineConfig) -> str:
        import httpx

        from rlinfer_sglang.supervision import _ensure_cpu_env

        _ensure_cpu_env(self.platform)  # the parser below imports SGLang, which reads it at import
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

    async def _attach(self, config: EngineConfig, url: str) -> None:
        http = self._http
        assert http is not None
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
        self._tp_size = int(info.get("tp_size") or 1)
        self._tokenizer = await asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)
        models = await http.get("/v1/models")  # the resolved context length (server_info: as given)
        context = next((m.get("max_model_len") for m in models.get("data") or () if m.get("max_model_len")), None)
        self._info = self._model_info(info, context or info.get("context_length"))
        self._specs = self._weight_specs(info)
        ok, message = await self._control(
            http, "/update_weight_version", {"new_version": wire.label(0), "abort_all_requests": False}
        )
        if not ok:
            raise BackendLoadError(f"the SGLang server refused its weight-version label: {message}")
        self._begin_end = await has_begin_end(http)
        from rlinfer_sglang.convert import priority_sign

        self._priority_sign = priority_sign(info)
        self._flush_needs_idle = not self._begin_end
        chat = getattr(self._tokenizer, "chat_template", None) is not None
        from rlinfer_sglang.backend import _amx_repacks

        self._caps = server_capabilities(self._caps, info, url, chat, _amx_repacks(), begin_end=self._begin_end)
        self._caps = self._caps.without(multimodal_off(self.config.model))

    def _load_tokenizer(self) -> Any:
        """The model's tokenizer, loaded as SGLang loads it (None when it cannot be loaded here)."""
        try:
            from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

            return get_tokenizer(self.config.tokenizer or self.config.model)
        except Exception:
            return None

    def _model_info(self, info: Mapping[str, Any], context: Any) -> ModelInfo:
        from rlinfer_sglang.config import _hf_config

        cfg = _hf_config(self.config.model) or {}
        eos: set[int] = set()
        generation: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            generation = json.loads((Path(self.config.model) / "generation_config.json").read_text())
        for found in (cfg.get("eos_token_id"), generation.get("eos_token_id")):
            eos |= {found} if isinstance(found, int) else set(found or ())
        tok_eos = getattr(self._tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int):
            eos.add(tok_eos)
        # as in-process: SGLang accepts prompts of at most max_req_input_len tokens
        if not isinstance(context, int):
            raise BackendLoadError(f"the SGLang server reports no context length (/v1/models): {context!r}")
        max_len = context
        limit = info.get("max_req_input_len")
        if self.config.max_model_len is not None:
            max_len = self.config.max_model_len
        elif isinstance(limit, int) and 0 < limit < max_len:
            max_len = limit + 1
        if "vocab_size" not in cfg:
            raise BackendLoadError(f"cannot read the vocabulary size of {self.config.model!r} (config.json)")
        tied = bool(cfg.get("tie_word_embeddings", False))
        return ModelInfo(
            vocab_size=int(cfg["vocab_size"]),
            max_model_len=max_len,
            eos_token_ids=tuple(sorted(eos)),
            tied_weights={"lm_head.weight": "model.embed_tokens.weight"} if tied else {},
            kv_capacity_tokens=kv_capacity_tokens(limit, max_len),
        )

    def _weight_specs(self, info: Mapping[str, Any]) -> dict[str, Any]:
        from rlinfer_core.transfer.disk import read_specs
        from rlinfer_core.weights import TensorSpec

        served = None if self.config.dtype == "auto" else str(info.get("dtype") or self.config.dtype)
        try:
            found = read_specs(self.config.model)
        except RLInferError as exc:
            raise BackendLoadError(f"cannot read the parameter names of {self.config.model!r}: {exc}") from exc
        return {name: TensorSpec(name, served or spec.dtype, spec.shape) for name, spec in found.items()}

    @hookimpl
    def rlinfer_capabilities(self) -> Capabilities:
        """Capabilities of this server (refined at start)."""
        return self._caps

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        """Vocabulary size, context length and EOS ids of the served model."""
        if self._info is None:
            raise EngineDead("the SGLang server backend is not started")
        return self._info

    @hookimpl
    async def rlinfer_check_health(self) -> None:
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

    @hookimpl
    async def rlinfer_shutdown(self) -> None:
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
        shutil.rmtree(self._result_dir, ignore_errors=True)

    @hookimpl
    def rlinfer_engine_processes(self) -> Mapping[str, int]:
        """``{role: pid}`` of the launched server's processes (``server``, ``scheduler``,
        ``detokenizer``); none for an attached server (not this engine's to manage)."""
        return {} if self._server is None else self._server.roles(SERVER_ROLE, role_of)


__all__ = ["SGLangServerBackend"]
