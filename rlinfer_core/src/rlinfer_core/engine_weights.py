"""The weights an engine serves, as the facade keeps them: their version, updates validated
before and verified after the load, the broadcast group, checksums, and the memory they live in
(released, resumed, discarded). :class:`~rlinfer_core.engine.AsyncEngine` holds one
:class:`Weights` and states its public methods."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, assert_never

import attrs

from rlinfer_core.backend import BroadcastBackend, ChecksumBackend, MemoryBackend, PrefixCacheBackend
from rlinfer_core.checksum import WeightChecksum, WeightVerification
from rlinfer_core.errors import (
    EngineDead,
    EngineTimeout,
    InvalidRequest,
    WeightsNotLoaded,
    WeightStagingError,
    WeightUpdateError,
    WeightVerificationError,
)
from rlinfer_core.preflight import as_memory_tags, as_weight_update, transport_name, update_target
from rlinfer_core.trainer_names import NameMap
from rlinfer_core.types import Capability, EngineConfig, MemoryTag
from rlinfer_core.weights import (
    BroadcastGroup,
    BroadcastSource,
    Buckets,
    CheckpointDir,
    NamedTensors,
    TensorSpec,
    WeightDelta,
    WeightSource,
    WeightUpdate,
)

if TYPE_CHECKING:
    from rlinfer_core.engine_calls import BackendCalls
    from rlinfer_core.model_info import ModelInfo
    from rlinfer_core.observers import Observers
    from rlinfer_core.staging import AsyncWeightStaging

UNVERIFIED = (
    "the last weight update was loaded but not served as sent (WeightVerificationError); load a full "
    "update_weights (every name of weight_specs) before generating"
)
DISCARDED = (
    "the engine holds no valid weights (released with discard_weights=True, or started with "
    "load_format='dummy'); load a full update_weights (every name of weight_specs) before generating"
)


def source_names(source: WeightSource) -> list[str]:
    """The tensor names a weight source carries (a checkpoint directory's from its headers)."""
    match source:
        case NamedTensors():
            return [name for name, _ in source.tensors]
        case Buckets():
            return [e.name for b in source.buckets for e in b.manifest.entries]
        case CheckpointDir():
            from rlinfer_core.transfer.disk import read_specs

            return list(read_specs(source.path))
        case BroadcastSource():
            return [s.name for s in source.specs]
        case _:
            assert_never(source)


def sent_tensors(source: NamedTensors | Buckets | CheckpointDir) -> list[tuple[str, Any]]:
    """The tensors an update carried, as the trainer sent them (a checkpoint directory read
    again; buckets unpacked to views of their data)."""
    match source:
        case NamedTensors():
            return list(source.tensors)
        case Buckets():
            from rlinfer_core.transfer.buckets import unpack_all

            return list(unpack_all(source.buckets, check=False))
        case CheckpointDir():
            from rlinfer_core.transfer.disk import read_tensors

            return list(read_tensors(source.path))
        case _:
            assert_never(source)


class Weights:
    """The served weights' state and every operation on it; the facade's public weight, memory
    and prefix-cache methods call these.

    Receives the facade's :class:`~rlinfer_core.engine_calls.BackendCalls` and observers, and
    callables for its config (read at every use: a caller may replace ``engine.config``), the
    model's facts (known once the engine started) and the staged update now open
    (:class:`~rlinfer_core.engine_staging.Staging`).
    """

    def __init__(
        self,
        calls: BackendCalls,
        config: Callable[[], EngineConfig],
        observers: Observers,
        model_info: Callable[[], ModelInfo | None],
        open_staging: Callable[[], AsyncWeightStaging | None],
    ) -> None:
        self._calls = calls
        self._config = config
        self._observers = observers
        self._model_info = model_info
        self._staging_open = open_staging
        #: the version now served: 0 at start, then what each update made live
        self.version = 0
        #: serialises updates, stagings and commits
        self.lock = asyncio.Lock()
        #: memory tags now released
        self.released: set[MemoryTag] = set()
        #: no valid weights: set by release_memory(discard_weights=True), a start with
        #: load_format="dummy" and a failed verification; cleared by the next full update
        self.discarded = config().load_format == "dummy"
        #: why generation is refused while ``discarded``
        self._not_loaded_reason = DISCARDED
        self._specs: Mapping[str, TensorSpec] | None = None

    @property
    def specs(self) -> Mapping[str, TensorSpec]:
        """HF parameter names the engine accepts, with dtype and shape (asked once)."""
        if self._specs is None:
            self._specs = dict(self._calls.backend.rlinfer_weight_specs())
        return self._specs

    def _tied(self) -> Mapping[str, str]:
        info = self._model_info()
        return info.tied_weights if info is not None else {}

    def require_loaded(self) -> None:
        """WeightsNotLoaded while the engine holds no valid weights (generation is refused)."""
        if self.discarded:
            raise WeightsNotLoaded(self._not_loaded_reason)

    # --- updates -------------------------------------------------------------------------------

    async def update(
        self, update: WeightUpdate | WeightSource | WeightDelta | Mapping[str, Any], version: int | None
    ) -> int:
        """``AsyncEngine.update_weights``."""
        self._calls.ensure_open()
        base: int | None = None
        if isinstance(update, WeightDelta):
            self._calls.capabilities.require(Capability.WEIGHTS_DELTA)
            base = update.base_version
            update = WeightUpdate(NamedTensors(update.tensors), version=version)
            transport = "delta"
        else:
            update = as_weight_update(update, version)
            transport = transport_name(update.source)
        name = self._calls.name
        async with self.lock:
            try:
                self._refuse_while_staging()
                update = attrs.evolve(update, source=self.under_checkpoint_names(update.source))
                target = update_target(update, self.version, self._calls.capabilities, self.released)
                self.check_refill(update.source, base)
                nbytes = self.validate(update.source)
                started = time.perf_counter()
                load = self._calls.backend.rlinfer_update_weights(attrs.evolve(update, version=target))
                await self.load_verified(load, [update.source], target, "update_weights")
            except Exception as exc:
                self._observers.emit("rlinfer_on_weight_update_failed", backend=name, transport=transport, error=exc)
                raise
        self._observers.emit(
            "rlinfer_on_weights_updated",
            backend=name,
            version=target,
            transport=transport,
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
        )
        return target

    async def load_verified(
        self, load: Awaitable[None], sources: Sequence[WeightSource], target: int, what: str
    ) -> None:
        """Await the backend's ``load`` (its errors typed), verify what the engine then serves
        against ``sources``, and make ``target`` the live version (an update and a staged commit)."""
        calls = self._calls
        try:
            await calls.with_timeout(load, self._config().request_timeout_s, what)
        except (WeightUpdateError, EngineDead, EngineTimeout):
            raise
        except Exception as exc:
            await calls.raise_if_dead(exc)
            raise WeightUpdateError(f"backend {calls.name!r} failed to load the update: {exc}") from exc
        await self._verify_update(*sources)
        self.version = target
        self.discarded = False
        self._not_loaded_reason = DISCARDED
        # a backend whose own update leaves no prefix of older weights reachable states it as
        # ``update_invalidates_prefixes`` (vLLM salts each request by weight version)
        if not getattr(calls.backend, "update_invalidates_prefixes", False):
            await self.reset_prefix_cache()

    def validate(self, source: WeightSource) -> int:
        """Validate ``source`` against :attr:`specs` (its bytes): everything, except the values of
        CUDA tensors where the backend states ``checks_cuda_tensor_values``: it checks them on
        the buckets it packs them into, before loading (one read instead of two)."""
        from rlinfer_core.transfer.ipc import all_cuda
        from rlinfer_core.transfer.validate import validate_source

        backend_checks = (
            isinstance(source, NamedTensors)
            and bool(getattr(self._calls.backend, "checks_cuda_tensor_values", False))
            and all_cuda(source.tensors)
        )
        return validate_source(source, self.specs, values=not backend_checks)

    def _refuse_while_staging(self) -> None:
        """An update while a staged update is open would make the staging's version and base
        stale: refused (commit or cancel the staging first)."""
        staging = self._staging_open()
        if staging is not None:
            raise WeightStagingError(
                f"a staged update ({staging.staging_id}, version {staging.version}) is open; "
                "commit or cancel it before update_weights"
            )

    @functools.cached_property
    def _trainer_names(self) -> NameMap:
        from rlinfer_core.trainer_names import name_map

        return name_map(self.specs)

    def under_checkpoint_names(self, source: WeightSource) -> WeightSource:
        """A trainer's tensors under the checkpoint's names (see :mod:`rlinfer_core.trainer_names`)."""
        from rlinfer_core.trainer_names import under_checkpoint_names

        return under_checkpoint_names(source, self._trainer_names)

    def checkpoint_names(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``AsyncEngine.checkpoint_names``."""
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        return self._trainer_names.to_checkpoint(pairs)

    @property
    def verifies_updates(self) -> bool:
        """``AsyncEngine.verifies_updates``."""
        return self._config().verify_updates and self._calls.capabilities.supports(Capability.WEIGHTS_CHECKSUM)

    async def _verify_update(self, *sources: WeightSource) -> None:
        """After a load: the engine's checksums of the updated tensors against the trainer's.

        On a difference the engine serves neither policy: generation is refused until a full
        update loads and verifies (WeightVerificationError). A broadcast's tensors never pass
        through this process, so a broadcast update is verified only by ``verify_weights``.
        """
        sent = [pair for source in sources if not isinstance(source, BroadcastSource) for pair in sent_tensors(source)]
        if not self.verifies_updates or not sent:
            return
        from rlinfer_core.checksum import verify

        weights_checksum = self._calls.optional(ChecksumBackend.rlinfer_weights_checksum)
        served = await self._calls.with_timeout(
            weights_checksum(), self._config().request_timeout_s, "weights_checksum"
        )
        result = verify(served, sent, self._tied())
        if not result.ok:
            self.discarded = True
            self._not_loaded_reason = UNVERIFIED
            raise WeightVerificationError(
                f"the engine loaded the update but does not serve it as sent ({len(result.mismatched)} "
                f"tensors differ, {len(result.missing)} not reported)",
                result.mismatched,
                result.missing,
            )

    def check_refill(self, source: WeightSource | frozenset[str], base: int | None) -> None:
        """Refuse a delta for another base version, and anything but a full update while the
        weights are discarded (``source``: an update's source, or the names it carries)."""
        if self.discarded:
            if base is not None:
                raise WeightUpdateError(
                    "a delta cannot be applied: the weights were released with discard_weights=True and "
                    "hold nothing it could apply to; send a full update (every name of weight_specs)"
                )
            missing = sorted(self._uncovered(source if isinstance(source, frozenset) else source_names(source)))
            if missing:
                raise WeightUpdateError(
                    f"the engine holds no valid weights (discard_weights=True or load_format='dummy'): only a "
                    f"full update fills them, "
                    f"and this one lacks {len(missing)} of the {len(self.specs)} tensors of weight_specs",
                    tuple(f"{name}: missing" for name in missing),
                )
        elif base is not None and base != self.version:
            raise WeightUpdateError(
                f"delta for base_version {base}, but the engine serves weight_version {self.version}; "
                f"send a delta against version {self.version} or a full update"
            )

    def _uncovered(self, names: Iterable[str]) -> set[str]:
        """Names of :attr:`specs` that ``names`` leave unset (a tied head counts as set by the
        tensor it is tied to)."""
        have = set(names)
        tied = self._tied()
        return {n for n in self.specs if n not in have and tied.get(n) not in have}

    # --- broadcast, checksums, prefix cache ----------------------------------------------------

    @property
    def broadcast_ranks(self) -> int:
        """``AsyncEngine.broadcast_ranks``."""
        ranks = getattr(self._calls.backend, "broadcast_ranks", None)
        return self._config().world_size if ranks is None else int(ranks)

    async def init_broadcast(self, group: BroadcastGroup) -> None:
        """``AsyncEngine.init_weight_broadcast``."""
        self._calls.ensure_open()
        init_weight_broadcast = self._calls.optional(BroadcastBackend.rlinfer_init_weight_broadcast)
        if group.rank_offset + self.broadcast_ranks > group.world_size:
            raise InvalidRequest(
                "world_size",
                f"the group needs at least rank_offset + {self.broadcast_ranks} engine ranks "
                f"= {group.rank_offset + self.broadcast_ranks}, got world_size={group.world_size}",
            )
        await self._calls.with_timeout(init_weight_broadcast(group), group.timeout_s + 30.0, "init_weight_broadcast")

    async def checksums(self) -> Mapping[str, WeightChecksum]:
        """``AsyncEngine.weights_checksum``."""
        self._calls.ensure_open()
        weights_checksum = self._calls.optional(ChecksumBackend.rlinfer_weights_checksum)
        if MemoryTag.WEIGHTS in self.released:
            raise InvalidRequest("engine_state", "weights are released; call resume_memory(['weights']) first")
        self.require_loaded()
        return await self._calls.with_timeout(weights_checksum(), self._config().request_timeout_s, "weights_checksum")

    async def verify(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> WeightVerification:
        """``AsyncEngine.verify_weights``."""
        from rlinfer_core.checksum import verify

        served = await self.checksums()
        return verify(served, self.checkpoint_names(tensors), self._tied())

    async def reset_prefix_cache(self) -> None:
        """Drop the engine's cached prefixes where it claims ``prefix_cache.reset``."""
        if self._calls.capabilities.supports(Capability.PREFIX_CACHE_RESET):
            reset = self._calls.optional(PrefixCacheBackend.rlinfer_reset_prefix_cache)
            await self._calls.with_timeout(reset(), 60.0, "reset_prefix_cache")

    # --- memory --------------------------------------------------------------------------------

    async def release_memory(
        self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None, discard_weights: bool
    ) -> None:
        """``AsyncEngine.release_memory``."""
        self._calls.ensure_open()
        capabilities = self._calls.capabilities
        wanted = as_memory_tags(tags, capabilities)
        if discard_weights:  # first: the error names what was asked for (its note says why)
            capabilities.require(Capability.MEMORY_DISCARD_WEIGHTS)
        release = self._calls.optional(MemoryBackend.rlinfer_release_memory)
        if discard_weights:
            if MemoryTag.WEIGHTS not in wanted:
                raise InvalidRequest("discard_weights", "needs the weights tag among the tags to release")
            if MemoryTag.WEIGHTS in self.released:
                raise InvalidRequest(
                    "discard_weights",
                    "the weights are already released with their host backup; resume_memory(['weights']) first",
                )
        todo = frozenset(wanted - self.released)
        if not todo:
            return
        started = time.perf_counter()
        call = release(todo, discard_weights=True) if discard_weights else release(todo)
        await self._calls.with_timeout(call, 300.0, "release_memory")
        self.released |= todo
        if discard_weights:
            self.discarded = True
        self._observers.emit(
            "rlinfer_on_memory_released", backend=self._calls.name, tags=todo, seconds=time.perf_counter() - started
        )

    async def resume_memory(self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None) -> None:
        """``AsyncEngine.resume_memory``."""
        self._calls.ensure_open()
        wanted = as_memory_tags(tags, self._calls.capabilities)
        resume = self._calls.optional(MemoryBackend.rlinfer_resume_memory)
        todo = frozenset(wanted & self.released)
        if not todo:
            return
        started = time.perf_counter()
        await self._calls.with_timeout(resume(todo), 300.0, "resume_memory")
        self.released -= todo
        self._observers.emit(
            "rlinfer_on_memory_resumed", backend=self._calls.name, tags=todo, seconds=time.perf_counter() - started
        )
