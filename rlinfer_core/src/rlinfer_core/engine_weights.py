"""The facade's weight-sync, memory and benchmark operations (part of ``AsyncEngine``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, assert_never

import attrs

from rlinfer_core.backend import (
    BenchBackend,
    BroadcastBackend,
    ChecksumBackend,
    MemoryBackend,
    PrefixCacheBackend,
    ProcessesBackend,
)
from rlinfer_core.checksum import WeightChecksum, WeightVerification
from rlinfer_core.engine_base import EngineBase
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
from rlinfer_core.types import Capability, GenerateRequest, MemoryTag
from rlinfer_core.weights import (
    BroadcastGroup,
    BroadcastSource,
    Buckets,
    CheckpointDir,
    NamedTensors,
    WeightDelta,
    WeightSource,
    WeightUpdate,
)

if TYPE_CHECKING:
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


class EngineWeights(EngineBase):
    """Weight sync, integrity checks, prefix cache, memory release and bench baselines."""

    #: set by release_memory(discard_weights=True) and by a start with load_format="dummy" (see
    #: AsyncEngine.open), cleared by the next (full) weight update
    _discarded: bool = False
    #: why generation is refused while ``_discarded``
    _not_loaded_reason: str = DISCARDED
    #: the staged update now open (rlinfer_core.engine_staging), if any
    _open_staging: AsyncWeightStaging | None = None

    # --- weight sync ---------------------------------------------------------------------------

    async def update_weights(
        self,
        update: WeightUpdate | WeightSource | WeightDelta | Mapping[str, Any],
        *,
        version: int | None = None,
    ) -> int:
        """Load new weights, all or nothing; return the new weight version.

        Accepts a WeightUpdate, a bare source, a ``{name: tensor}`` mapping, or a
        :class:`~rlinfer_core.weights.WeightDelta` (capability ``weights.delta``: loaded only when
        the engine serves its ``base_version``). Everything is validated against
        :attr:`weight_specs` before the engine is touched; on any failure WeightUpdateError is
        raised and the previous weights and version keep serving. After
        ``release_memory(discard_weights=True)`` only a full update (every name of
        :attr:`weight_specs`) is accepted.
        """
        self._ensure_open()
        base: int | None = None
        if isinstance(update, WeightDelta):
            self.capabilities.require(Capability.WEIGHTS_DELTA)
            base = update.base_version
            update = WeightUpdate(NamedTensors(update.tensors), version=version)
            transport = "delta"
        else:
            update = as_weight_update(update, version)
            transport = transport_name(update.source)
        async with self._weight_lock:
            try:
                self._refuse_while_staging()
                update = attrs.evolve(update, source=self._under_checkpoint_names(update.source))
                target = update_target(update, self._version, self.capabilities, self._released)
                self._check_refill(update.source, base)
                nbytes = self._validate(update.source)
                started = time.perf_counter()
                load = self._backend.rlinfer_update_weights(attrs.evolve(update, version=target))
                await self._load_verified(load, [update.source], target, "update_weights")
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

    async def _load_verified(
        self, load: Awaitable[None], sources: Sequence[WeightSource], target: int, what: str
    ) -> None:
        """Await the backend's ``load`` (its errors typed), verify what the engine then serves
        against ``sources``, and make ``target`` the live version (update_weights and a staged
        commit)."""
        try:
            await self._with_timeout(load, self.config.request_timeout_s, what)
        except (WeightUpdateError, EngineDead, EngineTimeout):
            raise
        except Exception as exc:
            await self._raise_if_dead(exc)
            raise WeightUpdateError(f"backend {self.backend_name!r} failed to load the update: {exc}") from exc
        await self._verify_update(*sources)
        self._version = target
        self._discarded = False
        self._not_loaded_reason = DISCARDED
        if not self._update_invalidates_prefixes():
            await self._reset_prefix_cache()

    def _update_invalidates_prefixes(self) -> bool:
        """Whether the backend's own update leaves no prefix computed by older weights reachable
        (the vLLM backend salts each request by weight version and resets only where that cannot hold); a
        backend states it as ``update_invalidates_prefixes``. Otherwise the facade resets the
        prefix cache after every update."""
        return bool(getattr(self._backend, "update_invalidates_prefixes", False))

    def _validate(self, source: WeightSource) -> int:
        """Validate ``source`` against :attr:`weight_specs` (its bytes): everything, except the
        values of CUDA tensors where the backend states ``checks_cuda_tensor_values``: it checks
        them on the buckets it packs them into, before loading (one read instead of two)."""
        from rlinfer_core.transfer.ipc import all_cuda
        from rlinfer_core.transfer.validate import validate_source

        backend_checks = (
            isinstance(source, NamedTensors)
            and bool(getattr(self._backend, "checks_cuda_tensor_values", False))
            and all_cuda(source.tensors)
        )
        return validate_source(source, self.weight_specs, values=not backend_checks)

    def _refuse_while_staging(self) -> None:
        """update_weights while a staged update is open would make the staging's version and
        base stale: refused (commit or cancel the staging first)."""
        if self._open_staging is not None:
            raise WeightStagingError(
                f"a staged update ({self._open_staging.staging_id}, version {self._open_staging.version}) is open; "
                "commit or cancel it before update_weights"
            )

    @functools.cached_property
    def _trainer_names(self) -> NameMap:
        from rlinfer_core.trainer_names import name_map

        return name_map(self.weight_specs)

    def _under_checkpoint_names(self, source: WeightSource) -> WeightSource:
        """A trainer's tensors under the checkpoint's names (see :mod:`rlinfer_core.trainer_names`)."""
        from rlinfer_core.trainer_names import under_checkpoint_names

        return under_checkpoint_names(source, self._trainer_names)

    def checkpoint_names(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``tensors`` under the names of :attr:`weight_specs`: a transformers >= 5 model's fused
        experts become one view per expert and projection (nothing is copied). Named tensors and
        buckets are converted by :meth:`update_weights` itself; a checkpoint directory or a
        broadcast must carry these names."""
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        return self._trainer_names.to_checkpoint(pairs)

    @property
    def verifies_updates(self) -> bool:
        """Whether every update is read back and compared (``EngineConfig.verify_updates`` on an
        engine with ``weights.checksum``)."""
        return self.config.verify_updates and self.capabilities.supports(Capability.WEIGHTS_CHECKSUM)

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

        weights_checksum = self._optional(ChecksumBackend.rlinfer_weights_checksum)
        served = await self._with_timeout(weights_checksum(), self.config.request_timeout_s, "weights_checksum")
        tied = self.model_info.tied_weights if self.model_info is not None else {}
        result = verify(served, sent, tied)
        if not result.ok:
            self._discarded = True
            self._not_loaded_reason = UNVERIFIED
            raise WeightVerificationError(
                f"the engine loaded the update but does not serve it as sent ({len(result.mismatched)} "
                f"tensors differ, {len(result.missing)} not reported)",
                result.mismatched,
                result.missing,
            )

    def _check_refill(self, source: WeightSource | frozenset[str], base: int | None) -> None:
        """Refuse a delta for another base version, and anything but a full update while the
        weights are discarded (``source``: an update's source, or the names it carries)."""
        if self._discarded:
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
                    f"and this one lacks {len(missing)} of the {len(self.weight_specs)} tensors of weight_specs",
                    tuple(f"{name}: missing" for name in missing),
                )
        elif base is not None and base != self._version:
            raise WeightUpdateError(
                f"delta for base_version {base}, but the engine serves weight_version {self._version}; "
                f"send a delta against version {self._version} or a full update"
            )

    def _uncovered(self, names: Iterable[str]) -> set[str]:
        """Names of weight_specs that ``names`` leave unset (a tied head counts as set by the
        tensor it is tied to)."""
        have = set(names)
        tied = self.model_info.tied_weights if self.model_info is not None else {}
        return {n for n in self.weight_specs if n not in have and tied.get(n) not in have}

    @property
    def weights_discarded(self) -> bool:
        """True between ``release_memory(discard_weights=True)`` and the next full update: the
        engine holds no valid weights and refuses generation (WeightsNotLoaded)."""
        return self._discarded

    def _validate_request(self, request: GenerateRequest) -> None:
        super()._validate_request(request)
        if self._discarded:
            raise WeightsNotLoaded(self._not_loaded_reason)

    @property
    def broadcast_ranks(self) -> int:
        """How many ranks of a broadcast group this engine takes: one per engine rank
        (``EngineConfig.world_size``: tensor x data x pipeline parallel sizes); a backend over
        several engines (``rlinfer_ray``'s pool) states its own count as ``broadcast_ranks``."""
        ranks = getattr(self._backend, "broadcast_ranks", None)
        return self.config.world_size if ranks is None else int(ranks)

    async def init_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Have the engine join the trainer's broadcast group (trainer is rank 0).

        Call it concurrently with :class:`rlinfer_core.transfer.broadcast.WeightBroadcaster`
        construction on the trainer side: both block until the group is formed.
        """
        self._ensure_open()
        init_weight_broadcast = self._optional(BroadcastBackend.rlinfer_init_weight_broadcast)
        if group.rank_offset + self.broadcast_ranks > group.world_size:
            raise InvalidRequest(
                "world_size",
                f"the group needs at least rank_offset + {self.broadcast_ranks} engine ranks "
                f"= {group.rank_offset + self.broadcast_ranks}, got world_size={group.world_size}",
            )
        await self._with_timeout(init_weight_broadcast(group), group.timeout_s + 30.0, "init_weight_broadcast")

    async def weights_checksum(self) -> Mapping[str, WeightChecksum]:
        """Checksums of every tensor the engine serves, computed inside the engine (HF names)."""
        self._ensure_open()
        weights_checksum = self._optional(ChecksumBackend.rlinfer_weights_checksum)
        if MemoryTag.WEIGHTS in self._released:
            raise InvalidRequest("engine_state", "weights are released; call resume_memory(['weights']) first")
        if self._discarded:
            raise WeightsNotLoaded(self._not_loaded_reason)
        return await self._with_timeout(weights_checksum(), self.config.request_timeout_s, "weights_checksum")

    async def verify_weights(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> WeightVerification:
        """Compare what the engine serves with the trainer's ``tensors`` (bit for bit, in the dtype
        the engine holds). A tied output head is checked against the embedding it is tied to."""
        from rlinfer_core.checksum import verify

        served = await self.weights_checksum()
        tied = self.model_info.tied_weights if self.model_info is not None else {}
        return verify(served, self.checkpoint_names(tensors), tied)

    def engine_processes(self) -> Mapping[str, int]:
        """The engine's child processes now running, ``{role: pid}``."""
        self._ensure_open()
        return self._optional(ProcessesBackend.rlinfer_engine_processes)()

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (after every weight update the facade or the backend does what is
        needed itself: :meth:`_update_invalidates_prefixes`)."""
        self._ensure_open()
        self.capabilities.require(Capability.PREFIX_CACHE_RESET)
        await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        if self.capabilities.supports(Capability.PREFIX_CACHE_RESET):
            reset = self._optional(PrefixCacheBackend.rlinfer_reset_prefix_cache)
            await self._with_timeout(reset(), 60.0, "reset_prefix_cache")

    # --- memory --------------------------------------------------------------------------------

    async def release_memory(
        self,
        tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None,
        *,
        discard_weights: bool = False,
    ) -> None:
        """Free accelerator memory for ``tags`` (default: all). Raises UnsupportedCapability where
        the platform cannot free it (e.g. CPU): never a silent no-op.

        ``discard_weights=True`` (capability ``memory.discard_weights``; ``tags`` must include
        weights) drops the weights without a host backup: faster, and no host memory used. After
        ``resume_memory(["weights"])`` the weights' memory is back but holds garbage, so
        generation is refused with WeightsNotLoaded until a full :meth:`update_weights` loads.
        The RL phase switch: release(discard) -> train -> resume(weights) -> update(full) ->
        resume(kv_cache) -> generate.
        """
        self._ensure_open()
        wanted = as_memory_tags(tags, self.capabilities)
        if discard_weights:  # first: the error names what was asked for (its note says why)
            self.capabilities.require(Capability.MEMORY_DISCARD_WEIGHTS)
        release = self._optional(MemoryBackend.rlinfer_release_memory)
        if discard_weights:
            if MemoryTag.WEIGHTS not in wanted:
                raise InvalidRequest("discard_weights", "needs the weights tag among the tags to release")
            if MemoryTag.WEIGHTS in self._released:
                raise InvalidRequest(
                    "discard_weights",
                    "the weights are already released with their host backup; resume_memory(['weights']) first",
                )
        todo = frozenset(wanted - self._released)
        if not todo:
            return
        started = time.perf_counter()
        call = release(todo, discard_weights=True) if discard_weights else release(todo)
        await self._with_timeout(call, 300.0, "release_memory")
        self._released |= todo
        if discard_weights:
            self._discarded = True
        self._observers.emit(
            "rlinfer_on_memory_released", backend=self.backend_name, tags=todo, seconds=time.perf_counter() - started
        )

    async def resume_memory(self, tags: Iterable[MemoryTag | str] | MemoryTag | str | None = None) -> None:
        """Re-allocate memory released by :meth:`release_memory` (default: all tags)."""
        self._ensure_open()
        wanted = as_memory_tags(tags, self.capabilities)
        resume = self._optional(MemoryBackend.rlinfer_resume_memory)
        todo = frozenset(wanted & self._released)
        if not todo:
            return
        started = time.perf_counter()
        await self._with_timeout(resume(todo), 300.0, "resume_memory")
        self._released -= todo
        self._observers.emit(
            "rlinfer_on_memory_resumed", backend=self.backend_name, tags=todo, seconds=time.perf_counter() - started
        )

    # --- benchmarking (Capability.BENCH; optional) ---------------------------------------------

    async def bench_raw_generate(self, requests: Sequence[GenerateRequest]) -> int:
        """Run ``requests`` through the engine's native API (no rlinfer conversion); tokens out."""
        self._ensure_open()
        raw_generate = self._optional(BenchBackend.rlinfer_bench_raw_generate)
        return await self._with_timeout(
            raw_generate(list(requests)), self.config.request_timeout_s, "bench_raw_generate"
        )

    async def bench_raw_weight_update(self, path: str) -> None:
        """The engine's own reload from a safetensors directory and nothing else (bench baseline):
        no validation, no version bump, no prefix-cache reset (call :meth:`reset_prefix_cache`)."""
        self._ensure_open()
        raw_update = self._optional(BenchBackend.rlinfer_bench_raw_weight_update)
        await self._with_timeout(raw_update(path), self.config.request_timeout_s, "bench_raw_weight_update")
