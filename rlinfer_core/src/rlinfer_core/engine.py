"""The Engine facade: what a trainer uses. Async-first, with a thin sync wrapper.

    async with await AsyncEngine.open("vllm", EngineConfig(model=path)) as engine:
        completions = await engine.generate([GenerateRequest(prompt_token_ids=[1, 2, 3])])
        await engine.update_weights(NamedTensors.of(model.named_parameters()))

The facade owns everything that must not differ between backends: request and weight-update
validation, capability checks, the weight version, timeouts, prefix-cache reset after a weight
change, and event hooks for observer plugins. The backend object only drives its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import attrs
import pluggy

from rlinfer_core import hookspecs
from rlinfer_core.admission import Admission
from rlinfer_core.checksum import WeightChecksum, WeightVerification
from rlinfer_core.discovery import BackendInfo, get_backend, plugin_objects
from rlinfer_core.errors import (
    EngineDead,
    EngineTimeout,
    InvalidRequest,
    RLInferError,
    UnsupportedCapability,
    WeightUpdateError,
)
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.observers import Observers
from rlinfer_core.types import (
    ALL_MEMORY_TAGS,
    PAUSE_CAPABILITY,
    Capabilities,
    Capability,
    Completion,
    CompletionDelta,
    EngineConfig,
    GenerateRequest,
    LogprobsMode,
    MemoryTag,
    PauseMode,
)
from rlinfer_core.weights import (
    BroadcastGroup,
    BroadcastSource,
    Buckets,
    CheckpointDir,
    NamedTensors,
    TensorSpec,
    WeightSource,
    WeightUpdate,
)

T = TypeVar("T")

TRANSPORT_CAPABILITY: Mapping[type, Capability] = {
    NamedTensors: Capability.WEIGHTS_TENSORS,
    Buckets: Capability.WEIGHTS_BUCKETS,
    CheckpointDir: Capability.WEIGHTS_DISK,
    BroadcastSource: Capability.WEIGHTS_BROADCAST,
}


def transport_name(source: WeightSource) -> str:
    """Short name of a weight source's transport ("tensors", "buckets", "disk", "broadcast")."""
    return TRANSPORT_CAPABILITY[type(source)].value.removeprefix("weights.")


def request_capabilities(request: GenerateRequest) -> list[Capability]:
    """The capabilities a request needs beyond plain generation."""
    s = request.sampling
    needed = []
    if request.messages is not None:
        needed.append(Capability.CHAT)
    if s.prompt_logprobs:
        needed.append(Capability.PROMPT_LOGPROBS)
    if s.logprobs:
        needed.append(Capability.TOP_LOGPROBS)
    if s.n > 1:
        needed.append(Capability.MULTI_SAMPLE)
    if s.seed is not None and not s.greedy:
        needed.append(Capability.SEEDED_SAMPLING)
    if s.stop:
        needed.append(Capability.STOP_STRINGS)
    if s.min_p > 0.0:
        needed.append(Capability.SAMPLING_MIN_P)
    if s.penalised:
        needed.append(Capability.SAMPLING_PENALTIES)
    if s.biased:
        needed.append(Capability.SAMPLING_LOGIT_BIAS)
    if s.logprobs_mode is LogprobsMode.RAW:
        needed.append(Capability.LOGPROBS_RAW)
    elif s.truncates and not s.greedy:
        needed.append(Capability.LOGPROBS_PROCESSED)
    return needed


def as_memory_tags(tags: Iterable[MemoryTag | str] | MemoryTag | str | None) -> frozenset[MemoryTag]:
    """Normalise tags; ``None`` means all tags."""
    if tags is None:
        return ALL_MEMORY_TAGS
    if isinstance(tags, str):
        tags = [tags]
    out = set()
    for tag in tags:
        try:
            out.add(MemoryTag(tag))
        except ValueError:
            raise InvalidRequest("tags", f"must be among {[t.value for t in MemoryTag]}, got {tag!r}") from None
    if not out:
        raise InvalidRequest("tags", "must name at least one memory tag")
    return frozenset(out)


class AsyncEngine:
    """One running engine behind the rlinfer contract. Build it with :meth:`open`."""

    def __init__(
        self,
        info: BackendInfo,
        backend: Any,
        config: EngineConfig,
        plugins: Sequence[Any] = (),
        entry_point_plugins: Sequence[Any] = (),
    ) -> None:
        self.backend_name = info.name
        self.config = config
        self._info = info
        self._backend = backend
        # operation hooks: the backend alone; observers live apart and cannot take them over
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._pm.register(backend, name=f"backend:{info.name}")
        self._observers = Observers(plugins, entry_point_plugins)
        self._admission = Admission()
        self._version = 0
        self._released: set[MemoryTag] = set()
        self._weight_lock = asyncio.Lock()
        self._closed = False
        self.capabilities: Capabilities = self._pm.hook.rlinfer_capabilities()
        self.model_info: ModelInfo | None = None
        self._weight_specs: Mapping[str, TensorSpec] | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        backend: str,
        config: EngineConfig | None = None,
        *,
        plugins: Sequence[Any] = (),
        load_entry_point_plugins: bool = True,
        **config_fields: Any,
    ) -> AsyncEngine:
        """Discover ``backend``, start its engine and return the facade.

        ``config`` or keyword fields of :class:`EngineConfig` (not both). Observer plugins from
        the ``rlinfer.plugins`` entry points are registered unless ``load_entry_point_plugins``
        is False; ``plugins`` adds more.
        """
        if config is None:
            config = EngineConfig(**config_fields)
        elif config_fields:
            config = attrs.evolve(config, **config_fields)
        info = get_backend(backend)
        extra = plugin_objects() if load_entry_point_plugins else []
        engine = cls(info, info.create(config), config, plugins, extra)
        started = time.perf_counter()
        try:
            await engine._with_timeout(engine._op("rlinfer_start", config=config), config.startup_timeout_s, "start")
            engine.capabilities = engine._pm.hook.rlinfer_capabilities()
            engine.model_info = engine._pm.hook.rlinfer_model_info()
        except BaseException:
            await engine._shutdown_quietly()
            raise
        engine._observers.emit(
            "rlinfer_on_engine_started",
            backend=info.name,
            capabilities=engine.capabilities,
            seconds=time.perf_counter() - started,
        )
        return engine

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop the engine and its processes. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._with_timeout(self._op("rlinfer_shutdown"), 120.0, "shutdown")
        finally:
            self._observers.emit("rlinfer_on_engine_shutdown", backend=self.backend_name)

    async def _shutdown_quietly(self) -> None:
        with contextlib.suppress(Exception):  # best effort; the start error is what matters
            await self.shutdown()

    async def check_health(self) -> None:
        """Raise EngineDead if the engine can no longer serve."""
        self._ensure_open()
        await self._with_timeout(self._op("rlinfer_check_health"), 30.0, "health check")

    @property
    def weight_version(self) -> int:
        """Version of the weights now served: 0 at start, +1 (or as requested) per update."""
        return self._version

    @property
    def weight_specs(self) -> Mapping[str, TensorSpec]:
        """HF parameter names the engine accepts, with dtype and shape."""
        if self._weight_specs is None:
            self._weight_specs = dict(self._pm.hook.rlinfer_weight_specs())
        return self._weight_specs

    @property
    def released(self) -> frozenset[MemoryTag]:
        """Memory tags now released."""
        return frozenset(self._released)

    # --- generate ------------------------------------------------------------------------------

    async def generate(self, requests: GenerateRequest | Sequence[GenerateRequest]) -> list[Completion]:
        """Generate completions: ``n`` per request, in request order, then sample index."""
        batch = [requests] if isinstance(requests, GenerateRequest) else list(requests)
        for request in batch:
            self._validate_request(request)
        if len({r.request_id for r in batch}) != len(batch):
            raise InvalidRequest("request_id", "request ids in one batch must be unique")
        if not batch:
            return []
        started = time.perf_counter()
        ids = [r.request_id for r in batch]
        try:
            async with self._admission.admit(ids, self.config.request_timeout_s):
                completions = await self._with_timeout(
                    self._op("rlinfer_generate", requests=batch),
                    self.config.request_timeout_s,
                    "generate",
                    on_timeout=lambda: self._abort_quietly(ids),
                )
        except RLInferError:
            raise
        except Exception as exc:
            await self._raise_if_dead(exc)
            raise
        stamped = [self._stamp(c) for c in completions]
        self._observers.emit(
            "rlinfer_on_generate_done",
            backend=self.backend_name,
            requests=batch,
            completions=stamped,
            seconds=time.perf_counter() - started,
        )
        return stamped

    def _stamp(self, completion: Completion) -> Completion:
        """Fill ``token_versions`` where a backend left them out (exact when no update overlapped
        the request) and set ``weight_version`` to the newest token's version."""
        versions = completion.token_versions
        if versions is None:
            versions = (self._version,) * len(completion.token_ids)
        newest = max(versions) if versions else self._version
        return attrs.evolve(completion, token_versions=tuple(versions), weight_version=newest)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Stream one request's deltas; they concatenate to the batch result."""
        self.capabilities.require(Capability.STREAM)
        self._validate_request(request)
        async with self._admission.admit([request.request_id], self.config.request_timeout_s):
            async for delta in self._stream_admitted(request):
                yield delta

    async def _stream_admitted(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        iterator = cast(AsyncIterator[CompletionDelta], self._op("rlinfer_generate_stream", request=request))
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    delta = await asyncio.wait_for(anext(iterator), timeout=max(remaining, 0.001))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    await self._abort_quietly([request.request_id])
                    raise EngineTimeout(
                        f"stream of {request.request_id!r} exceeded request_timeout_s="
                        f"{self.config.request_timeout_s}; the request was aborted"
                    ) from None
                versions = delta.token_versions
                if versions is None:
                    versions = (self._version,) * len(delta.token_ids)
                yield attrs.evolve(
                    delta, token_versions=tuple(versions), weight_version=max(versions, default=self._version)
                )
        finally:
            await iterator.aclose()  # type: ignore[attr-defined]  # an async generator

    async def abort(self, request_ids: Sequence[str] | str | None = None) -> None:
        """Abort requests (``None``: all in flight); their callers get partial tokens, "abort"."""
        self._ensure_open()
        self.capabilities.require(Capability.ABORT)
        ids = [request_ids] if isinstance(request_ids, str) else (None if request_ids is None else list(request_ids))
        await self._with_timeout(self._op("rlinfer_abort", request_ids=ids), 60.0, "abort")

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation (see PauseMode for what happens to in-flight requests)."""
        self._ensure_open()
        try:
            pause_mode = PauseMode(mode)
        except ValueError:
            raise InvalidRequest("mode", f"must be one of {[m.value for m in PauseMode]}, got {mode!r}") from None
        self.capabilities.require(PAUSE_CAPABILITY[pause_mode])
        # Every request handed to generate/stream before this call is covered by the mode, even
        # one the engine has not registered yet: new ones wait at the gate until resume().
        self._admission.close_gate()
        try:
            if pause_mode is PauseMode.WAIT:
                await self._with_timeout(self._admission.drained(), self.config.request_timeout_s, "pause(wait)")
            await self._with_timeout(self._op("rlinfer_pause", mode=pause_mode), self.config.request_timeout_s, "pause")
            if pause_mode is PauseMode.ABORT and self._admission.in_flight:
                await self._with_timeout(
                    self._op("rlinfer_abort", request_ids=sorted(self._admission.in_flight)), 60.0, "pause(abort)"
                )
        except BaseException:
            self._admission.open_gate()
            raise

    async def resume(self) -> None:
        """Resume generation after :meth:`pause`."""
        self._ensure_open()
        try:
            await self._with_timeout(self._op("rlinfer_resume"), 60.0, "resume")
        finally:
            self._admission.open_gate()

    @property
    def in_flight(self) -> frozenset[str]:
        """Request ids handed to generate/stream that have not returned yet."""
        return self._admission.in_flight

    def _validate_request(self, request: GenerateRequest) -> None:
        self._ensure_open()
        if not isinstance(request, GenerateRequest):
            raise InvalidRequest("requests", f"must be GenerateRequest objects, got {type(request).__name__}")
        for capability in request_capabilities(request):
            self.capabilities.require(capability)
        if MemoryTag.KV_CACHE in self._released or MemoryTag.WEIGHTS in self._released:
            raise InvalidRequest(
                "engine_state", f"memory {sorted(self._released)} is released; call resume_memory() first"
            )
        info = self.model_info
        if info is None or request.prompt_token_ids is None:
            return
        for i, token in enumerate(request.prompt_token_ids):
            if token >= info.vocab_size:
                raise InvalidRequest(
                    "prompt_token_ids", f"item {i} must be < vocab_size ({info.vocab_size}), got {token}"
                )
        sampling = request.sampling
        for field, tokens in (
            ("stop_token_ids", sampling.stop_token_ids),
            ("logit_bias", [t for t, _ in sampling.logit_bias]),
            ("allowed_token_ids", sampling.allowed_token_ids or ()),
        ):
            for token in tokens:
                if token >= info.vocab_size:
                    raise InvalidRequest(field, f"token ids must be < vocab_size ({info.vocab_size}), got {token}")
        if len(request.prompt_token_ids) >= info.max_model_len:
            raise InvalidRequest(
                "prompt_token_ids",
                f"prompt of {len(request.prompt_token_ids)} tokens must be shorter than "
                f"max_model_len ({info.max_model_len})",
            )

    # --- weight sync ---------------------------------------------------------------------------

    async def update_weights(
        self, update: WeightUpdate | WeightSource | Mapping[str, Any], *, version: int | None = None
    ) -> int:
        """Load new weights, all or nothing; return the new weight version.

        Accepts a WeightUpdate, a bare source, or a ``{name: tensor}`` mapping. Everything is
        validated against :attr:`weight_specs` before the engine is touched; on any failure
        WeightUpdateError is raised and the previous weights and version keep serving.
        """
        self._ensure_open()
        if isinstance(update, Mapping):
            update = NamedTensors.of(dict(update))
        if not isinstance(update, WeightUpdate):
            update = WeightUpdate(update, version=version)
        transport = transport_name(update.source)
        async with self._weight_lock:
            try:
                self.capabilities.require(TRANSPORT_CAPABILITY[type(update.source)])
                target = self._version + 1 if update.version is None else update.version
                if target <= self._version:
                    raise WeightUpdateError(
                        f"version {target} must be greater than the current version {self._version}"
                    )
                if MemoryTag.WEIGHTS in self._released:
                    raise WeightUpdateError("weights are released; call resume_memory(['weights']) first")
                from rlinfer_core.transfer.validate import validate_source

                nbytes = validate_source(update.source, self.weight_specs)
                started = time.perf_counter()
                try:
                    await self._with_timeout(
                        self._op("rlinfer_update_weights", update=attrs.evolve(update, version=target)),
                        self.config.request_timeout_s,
                        "update_weights",
                    )
                except (WeightUpdateError, EngineDead, EngineTimeout):
                    raise
                except Exception as exc:
                    await self._raise_if_dead(exc)
                    raise WeightUpdateError(f"backend {self.backend_name!r} failed to load the update: {exc}") from exc
                self._version = target
                await self._reset_prefix_cache()
            except Exception as exc:
                self._observers.emit(
                    "rlinfer_on_weight_update_failed", backend=self.backend_name, transport=transport, error=exc
                )
                raise
        self._observers.emit(
            "rlinfer_on_weights_updated",
            backend=self.backend_name,
            version=target,
            transport=transport,
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
        )
        return target

    @property
    def broadcast_ranks(self) -> int:
        """How many ranks of a broadcast group this engine takes (one per tensor-parallel worker)."""
        return self.config.tensor_parallel_size

    async def init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have the engine join the trainer's broadcast group (trainer is rank 0).

        Call it concurrently with :class:`rlinfer_core.transfer.broadcast.WeightBroadcaster`
        construction on the trainer side: both block until the group is formed.
        """
        self._ensure_open()
        self.capabilities.require(Capability.WEIGHTS_BROADCAST)
        if group.rank_offset + self.broadcast_ranks > group.world_size:
            raise InvalidRequest(
                "world_size",
                f"the group needs at least rank_offset + {self.broadcast_ranks} engine ranks "
                f"= {group.rank_offset + self.broadcast_ranks}, got world_size={group.world_size}",
            )
        await self._with_timeout(
            self._op("rlinfer_init_weight_broadcast", group=group), group.timeout_s + 30.0, "init_weight_broadcast"
        )

    async def weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums of every tensor the engine serves, computed inside the engine (HF names)."""
        self._ensure_open()
        self.capabilities.require(Capability.WEIGHTS_CHECKSUM)
        if MemoryTag.WEIGHTS in self._released:
            raise InvalidRequest("engine_state", "weights are released; call resume_memory(['weights']) first")
        result: Mapping[str, WeightChecksum] = await self._with_timeout(
            self._op("rlinfer_weights_checksum"), self.config.request_timeout_s, "weights_checksum"
        )
        return result

    async def verify_weights(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> WeightVerification:
        """Compare what the engine serves with the trainer's ``tensors`` (bit for bit, in the dtype
        the engine holds). A tied output head is checked against the embedding it is tied to."""
        from rlinfer_core.checksum import verify

        served = await self.weights_checksum()
        tied = self.model_info.tied_weights if self.model_info is not None else {}
        return verify(served, tensors, tied)

    def engine_processes(self) -> Mapping[str, int]:
        """The engine's child processes now running, ``{role: pid}``."""
        self._ensure_open()
        result: Mapping[str, int] | None = self._pm.hook.rlinfer_engine_processes()
        if result is None:
            raise UnsupportedCapability("engine_processes", self.backend_name, "the backend does not report them")
        return result

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (done automatically after every weight update)."""
        self._ensure_open()
        self.capabilities.require(Capability.PREFIX_CACHE_RESET)
        await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        if self.capabilities.supports(Capability.PREFIX_CACHE_RESET):
            await self._with_timeout(self._op("rlinfer_reset_prefix_cache"), 60.0, "reset_prefix_cache")

    # --- memory --------------------------------------------------------------------------------

    async def release_memory(self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None) -> None:
        """Free accelerator memory for ``tags`` (default: all). Raises UnsupportedCapability where
        the platform cannot free it (e.g. CPU): never a silent no-op."""
        self._ensure_open()
        wanted = as_memory_tags(tags)
        self.capabilities.require(Capability.MEMORY_RELEASE)
        todo = frozenset(wanted - self._released)
        if not todo:
            return
        started = time.perf_counter()
        await self._with_timeout(self._op("rlinfer_release_memory", tags=todo), 300.0, "release_memory")
        self._released |= todo
        self._observers.emit(
            "rlinfer_on_memory_released", backend=self.backend_name, tags=todo, seconds=time.perf_counter() - started
        )

    async def resume_memory(self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None) -> None:
        """Re-allocate memory released by :meth:`release_memory` (default: all tags)."""
        self._ensure_open()
        wanted = as_memory_tags(tags)
        self.capabilities.require(Capability.MEMORY_RELEASE)
        todo = frozenset(wanted & self._released)
        if not todo:
            return
        started = time.perf_counter()
        await self._with_timeout(self._op("rlinfer_resume_memory", tags=todo), 300.0, "resume_memory")
        self._released -= todo
        self._observers.emit(
            "rlinfer_on_memory_resumed", backend=self.backend_name, tags=todo, seconds=time.perf_counter() - started
        )

    # --- benchmarking --------------------------------------------------------------------------

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """Run ``requests`` through the engine's native API (no rlinfer conversion); tokens out."""
        self._ensure_open()
        result: int = await self._op("rlinfer_bench_raw_generate", requests=list(requests))
        return result

    async def bench_raw_weight_update(self, path: str) -> None:
        """The engine's own reload from a safetensors directory, unvalidated (bench baseline)."""
        self._ensure_open()
        await self._op("rlinfer_bench_raw_weight_update", path=path)
        await self._reset_prefix_cache()

    # --- plumbing ------------------------------------------------------------------------------

    def _op(self, hook_name: str, **kwargs: Any) -> Awaitable[Any]:
        result = getattr(self._pm.hook, hook_name)(**kwargs)
        if result is None:
            raise UnsupportedCapability(hook_name, self.backend_name, "the backend does not implement this hook")
        return result  # type: ignore[no-any-return]

    def _ensure_open(self) -> None:
        if self._closed:
            raise EngineDead(f"engine {self.backend_name!r} was shut down; open a new one")

    async def _with_timeout(
        self,
        awaitable: Awaitable[T],
        timeout: float,
        what: str,
        on_timeout: Any = None,
    ) -> T:
        try:
            return await asyncio.wait_for(awaitable, timeout=timeout)
        except TimeoutError:
            if on_timeout is not None:
                await on_timeout()
            raise EngineTimeout(
                f"{what} did not finish within {timeout:.0f} s on backend {self.backend_name!r}; "
                f"raise EngineConfig.request_timeout_s if the work is legitimately long"
            ) from None

    async def _abort_quietly(self, request_ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # the timeout error is what the caller must see
            await asyncio.wait_for(self._op("rlinfer_abort", request_ids=request_ids), timeout=10.0)

    async def _raise_if_dead(self, exc: BaseException) -> None:
        try:
            await asyncio.wait_for(self._op("rlinfer_check_health"), timeout=10.0)
        except EngineDead:
            raise
        except TimeoutError:
            raise EngineDead(f"engine {self.backend_name!r} stopped answering after: {exc}") from exc


# the sync wrapper lives in its own module; importable from here as before
from rlinfer_core.sync_engine import Engine, open_engine  # noqa: E402

__all__ = ["AsyncEngine", "Engine", "open_engine", "request_capabilities", "transport_name"]
