"""The kit's session state: one engine, the oracle, the report, and which weights are served."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rlinfer_conformance import trainer_side
from rlinfer_conformance.oracle import Oracle, Parity
from rlinfer_conformance.report import KitReport
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.types import Capability, Completion, EngineConfig, GenerateRequest, SamplingParams
from rlinfer_core.weights import Buckets, CheckpointDir, NamedTensors, WeightSource

if TYPE_CHECKING:
    from rlinfer_core.engine import Engine
    from rlinfer_core.transfer.broadcast import WeightBroadcaster

T = TypeVar("T")

#: the parity tolerance on per-token logprobs (float32 on CPU)
#: float32 on CPU matches the oracle to ~1e-6; GPU kernels need --rlinfer-logprob-tol (e.g. 1e-3)
DEFAULT_LOGPROB_TOLERANCE = 1e-5
LOGPROB_TOLERANCE = float(os.environ.get("RLINFER_LOGPROB_TOL", str(DEFAULT_LOGPROB_TOLERANCE)))
#: every kit operation that runs in a helper thread is bounded by this
OP_TIMEOUT_S = 120.0
#: the kit's weight groups: how long each side of a broadcast may wait (BroadcastGroup.timeout_s)
BROADCAST_TIMEOUT_S = 60.0
#: small buckets so that a tiny model still spans several of them
SMALL_BUCKET_BYTES = 64 << 10

BASE = "seed0"
OTHER = "seed1"

#: transports that a weight update can use without a broadcast group
LOCAL_TRANSPORTS = (Capability.WEIGHTS_TENSORS, Capability.WEIGHTS_BUCKETS, Capability.WEIGHTS_DISK)
#: transports whose tensors live on the trainer's device (so CUDA IPC with a GPU trainer)
CUDA_IPC_TRANSPORTS = (Capability.WEIGHTS_TENSORS, Capability.WEIGHTS_BUCKETS)


class EventRecorder:
    """Observer plugin registered in the kit's engine: records every ``rlinfer_on_...`` event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def names(self) -> list[str]:
        """Names of the events seen so far, in order."""
        return [name for name, _ in self.events]

    @hookimpl
    def rlinfer_on_engine_started(self, backend: str, capabilities: Any, seconds: float) -> None:
        """Record."""
        self.events.append(("rlinfer_on_engine_started", {"backend": backend, "seconds": seconds}))

    @hookimpl
    def rlinfer_on_generate_done(self, backend: str, requests: Any, completions: Any, seconds: float) -> None:
        """Record."""
        self.events.append(("rlinfer_on_generate_done", {"n": len(completions)}))

    @hookimpl
    def rlinfer_on_weights_updated(
        self, backend: str, version: int, transport: str, nbytes: int, seconds: float
    ) -> None:
        """Record."""
        self.events.append(("rlinfer_on_weights_updated", {"version": version, "transport": transport}))

    @hookimpl
    def rlinfer_on_weight_update_failed(self, backend: str, transport: str, error: Exception) -> None:
        """Record."""
        self.events.append(("rlinfer_on_weight_update_failed", {"transport": transport, "error": type(error).__name__}))

    @hookimpl
    def rlinfer_on_memory_released(self, backend: str, tags: Any, seconds: float) -> None:
        """Record."""
        self.events.append(("rlinfer_on_memory_released", {"tags": sorted(tags)}))

    @hookimpl
    def rlinfer_on_memory_resumed(self, backend: str, tags: Any, seconds: float) -> None:
        """Record."""
        self.events.append(("rlinfer_on_memory_resumed", {"tags": sorted(tags)}))

    @hookimpl
    def rlinfer_on_engine_shutdown(self, backend: str) -> None:
        """Record."""
        self.events.append(("rlinfer_on_engine_shutdown", {}))


def make_models(tmp: Path, architecture: str, spec_fields: Mapping[str, Any] | None = None) -> tuple[Path, Path]:
    """The kit's two tiny models of ``architecture``: seed 0 (served at start) and seed 1
    (``spec_fields``: other TinyModelSpec fields, e.g. a longer ``max_position_embeddings``)."""
    from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(architecture=architecture, **(spec_fields or {}))
    base = make_tiny_model(tmp / f"{architecture}-seed0", seed=0, spec=spec)
    return base, make_tiny_model(tmp / f"{architecture}-seed1", seed=1, spec=spec)


def open_or_skip(
    backend: str, config: EngineConfig, report: KitReport, label: str, why: str, plugins: Sequence[object] = ()
) -> Engine:
    """An engine of its own for a per-architecture test, its start time in the report as
    ``engine_start_<label>``; a backend's UnsupportedCapability skips the test with ``why`` and the
    backend's reason (the skip and its reason are kept in the report)."""
    import pytest

    from rlinfer_core.engine import open_engine
    from rlinfer_core.errors import UnsupportedCapability

    started = time.perf_counter()
    try:
        engine = open_engine(backend, config, plugins=list(plugins))
    except UnsupportedCapability as exc:
        pytest.skip(f"{why}: {exc}")
    report.timings[f"engine_start_{label}"] = time.perf_counter() - started
    return engine


def outcome_of(future: concurrent.futures.Future[Any], timeout_s: float = OP_TIMEOUT_S) -> str:
    """What a helper-thread call came to, in words (its result, its error, or still running)."""
    try:
        return f"returned {future.result(timeout=timeout_s)!r}"
    except concurrent.futures.TimeoutError:
        if not future.done():
            return f"still running after {timeout_s:.0f} s more"
        return f"raised {type(future.exception()).__name__}: {future.exception()}"
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"


def generate_unless_wedged(
    world: KitWorld, requests: list[GenerateRequest], wedged: list[BaseException]
) -> list[Completion]:
    """Generate, unless the engine already timed out or died on an earlier example: then raise
    that error again at once. hypothesis shrinks a failure by running more examples, and each
    would wait out ``request_timeout_s`` on a wedged engine (a test that looks hung)."""
    from rlinfer_core.errors import EngineDead, EngineTimeout

    if wedged:
        raise wedged[0]
    try:
        return world.generate(requests)
    except (EngineTimeout, EngineDead) as exc:
        exc.add_note(f"on the requests {requests!r}; later examples raise this again without calling the engine")
        wedged.append(exc)
        raise


def default_config(model_dir: Path, overrides: Mapping[str, Any]) -> EngineConfig:
    """The kit's engine: float32, short context, small KV cache, seed 0, bounded timeouts."""
    fields: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 << 20,
        "max_num_seqs": 16,
        "seed": 0,
        "request_timeout_s": OP_TIMEOUT_S,
        "startup_timeout_s": 600.0,
    }
    fields.update(overrides)
    return EngineConfig(**fields)


@contextlib.contextmanager
def own_world(
    backend: str,
    overrides: Mapping[str, Any],
    report: KitReport,
    tmp: Path,
    architecture: str,
    label: str,
    why: str,
    spec_fields: Mapping[str, Any] | None = None,
) -> Iterator[KitWorld]:
    """An engine of its own (the kit's config with ``overrides``) on the two tiny models of
    ``architecture`` (``spec_fields``: see :func:`make_models`), with their oracle; shut down on
    exit. ``label`` and ``why``: see :func:`open_or_skip`."""
    from rlinfer_conformance.oracle import tie_band

    base_dir, other_dir = make_models(tmp, architecture, spec_fields)
    config = default_config(base_dir, overrides)
    oracle = Oracle(weight_dtype=config.dtype, tie_tolerance=tie_band(LOGPROB_TOLERANCE))
    oracle.add(BASE, base_dir)
    oracle.add(OTHER, other_dir)
    events = EventRecorder()
    engine = open_or_skip(backend, config, report, label, why, [events])
    world = KitWorld(engine, oracle, report, events, tmp, architecture=architecture)
    try:
        yield world
    finally:
        world.close()
        engine.shutdown()


class KitWorld:
    """One engine shared by the whole kit run, with the oracle and the report.

    ``current`` is the oracle key of the weights the engine serves now; tests that change the
    weights keep it up to date, and :meth:`restore` brings the base weights back.
    """

    def __init__(
        self,
        engine: Engine,
        oracle: Oracle,
        report: KitReport,
        events: EventRecorder,
        tmp: Path,
        architecture: str = "llama",
        *,
        pooled: bool = False,
    ) -> None:
        self.engine = engine
        #: the engine is a pool: sent tensors reach the replicas through Ray, not CUDA IPC
        self.pooled = pooled
        #: CUDA IPC handles handed out by the kit's updates so far (a CUDA trainer device only)
        self.cuda_ipc_handles = 0
        self.architecture = architecture
        self.oracle = oracle
        self.report = report
        self.events = events
        self.tmp = tmp
        self.current = BASE
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlinfer-kit")
        self._counter = 0

    # --- facts -----------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """Backend name."""
        return self.engine.backend_name

    def supports(self, capability: Capability) -> bool:
        """True when the engine claims ``capability``."""
        return self.engine.capabilities.supports(capability)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size reported by the engine."""
        info = self.engine.model_info
        assert info is not None, "model_info must be set after start"
        return info.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """EOS ids reported by the engine."""
        info = self.engine.model_info
        assert info is not None
        return info.eos_token_ids

    @property
    def max_model_len(self) -> int:
        """Context length reported by the engine."""
        info = self.engine.model_info
        assert info is not None
        return info.max_model_len

    def prompts(self) -> list[list[int]]:
        """A fixed, varied set of prompts (token ids) for parity checks."""
        tok = self.oracle.tokenizer
        texts = ["The quick brown fox", "Question: what is 2 + 3? Answer:", "hello", "Numbers: 0 1 2 3"]
        out = [list(tok(t, add_special_tokens=False).input_ids) for t in texts]
        out.append([1, *range(40, 70, 3)])
        out.append([7])
        return out

    def request_id(self, prefix: str = "kit") -> str:
        """A fresh request id."""
        self._counter += 1
        return f"{prefix}-{self._counter}"

    def greedy_requests(self, max_tokens: int = 12, **sampling: Any) -> list[GenerateRequest]:
        """Greedy requests over :meth:`prompts`."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling)
        return [
            GenerateRequest(prompt_token_ids=p, sampling=params, request_id=self.request_id()) for p in self.prompts()
        ]

    # --- running things --------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Generate and time it."""
        started = time.perf_counter()
        out = self.engine.generate(list(requests))
        self.report.timings["generate_total"] = self.report.timings.get("generate_total", 0.0) + (
            time.perf_counter() - started
        )
        return out

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        """Run ``fn`` in a helper thread (e.g. a generate that another call will abort)."""
        return self.pool.submit(fn, *args, **kwargs)

    def check_parity(
        self, checkpoint: str | None, requests: Sequence[GenerateRequest], completions: Sequence[Completion]
    ) -> Parity:
        """Compare completions with the oracle for the served weights; assert and record."""
        parity = self.oracle.check_all(self.current, requests, completions)
        if checkpoint is not None:
            self.report.record_parity(
                checkpoint,
                parity.max_abs_logprob_delta,
                parity.tokens_checked,
                len(parity.argmax_mismatches),
                self.architecture,
            )
        assert not parity.argmax_mismatches, "greedy tokens differ from the oracle's argmax:\n" + "\n".join(
            parity.argmax_mismatches[:10]
        )
        assert parity.max_abs_logprob_delta <= LOGPROB_TOLERANCE, (
            f"max |logprob - oracle| = {parity.max_abs_logprob_delta:.3g} > {LOGPROB_TOLERANCE} "
            f"(weights {self.current}, {parity.tokens_checked} tokens, {self.architecture})"
        )
        return parity

    def generate_and_check(self, checkpoint: str | None, max_tokens: int = 12) -> list[Completion]:
        """Greedy batch over the fixed prompts, checked against the oracle."""
        requests = self.greedy_requests(max_tokens=max_tokens)
        completions = self.generate(requests)
        self.check_parity(checkpoint, requests, completions)
        return completions

    # --- weights ---------------------------------------------------------------------------

    def local_transports(self) -> list[Capability]:
        """Claimed transports usable without a broadcast group."""
        return [t for t in LOCAL_TRANSPORTS if self.supports(t)]

    def source(self, transport: Capability, key: str) -> WeightSource:
        """A full weight source for oracle model ``key`` over ``transport``."""
        tensors = self.oracle.named_parameters(key)
        if transport in CUDA_IPC_TRANSPORTS:
            tensors = trainer_side.to_trainer(tensors)
        if transport is Capability.WEIGHTS_TENSORS:
            return NamedTensors.of(tensors)
        if transport is Capability.WEIGHTS_BUCKETS:
            from rlinfer_core.transfer.buckets import pack

            return Buckets(pack(tensors, max_bucket_bytes=SMALL_BUCKET_BYTES))
        if transport is Capability.WEIGHTS_DISK:
            from rlinfer_core.transfer.disk import save_dir

            path = self.tmp / f"ckpt-{key}"
            if not path.exists():
                save_dir(self.engine.checkpoint_names(tensors), path)
            return CheckpointDir(str(path))
        raise ValueError(f"no local source for {transport}")

    def update(self, transport: Capability, key: str) -> int:
        """Load oracle model ``key`` over ``transport``; asserts the version went up by one."""
        before = self.engine.weight_version
        started = time.perf_counter()
        if transport is Capability.WEIGHTS_BROADCAST:
            version = self.broadcast_update(key)
        elif transport in CUDA_IPC_TRANSPORTS and trainer_side.on_gpu() and not self.pooled:
            source = self.source(transport, key)
            with trainer_side.counting_cuda_ipc_handles() as handles:
                version = self.engine.update_weights(source)
            assert handles() > 0, (
                f"{transport.value}: the trainer's tensors are on {trainer_side.device()}, but no CUDA IPC "
                "handle was handed out: they reached the engine some other way"
            )
            self.cuda_ipc_handles += handles()
        else:
            version = self.engine.update_weights(self.source(transport, key))
        name = f"update_{transport.value.removeprefix('weights.')}"
        self.report.timings[name] = time.perf_counter() - started
        self.current = key
        assert version == before + 1 == self.engine.weight_version, (before, version, self.engine.weight_version)
        self.verify_served(key, f"after {transport.value} update to {key}")
        return version

    def verify_served(self, key: str, when: str) -> None:
        """Integrity readback: the engine serves oracle model ``key`` bit for bit (when the
        backend claims ``weights.checksum``)."""
        if not self.supports(Capability.WEIGHTS_CHECKSUM):
            return
        result = self.engine.verify_weights(self.oracle.named_parameters(key))
        assert result.ok, (
            f"{when}: the engine does not serve what was sent: mismatched {list(result.mismatched)}, "
            f"missing {list(result.missing)} ({self.architecture})"
        )

    @contextlib.contextmanager
    def broadcast_sender(self, timeout_s: float = BROADCAST_TIMEOUT_S) -> Iterator[WeightBroadcaster]:
        """The kit's trainer (rank 0, rlinfer_core's side) of a fresh weight group the engine
        joined: gloo from CPU tensors, or NCCL from the trainer's GPU (``--rlinfer-broadcast-backend``)."""
        from rlinfer_core.transfer.broadcast import WeightBroadcaster, free_port
        from rlinfer_core.weights import BroadcastGroup

        ranks = 1 + self.engine.broadcast_ranks  # trainer + every engine rank (TP workers, pool replicas)
        backend = trainer_side.broadcast_backend()
        group = BroadcastGroup("127.0.0.1", free_port(), world_size=ranks, backend=backend, timeout_s=timeout_s)
        joined = self.submit(self.engine.init_weight_broadcast, group)
        trainer_side.use_trainer_device()
        sender = WeightBroadcaster(group)
        try:
            joined.result(timeout=OP_TIMEOUT_S)
            yield sender
        finally:
            sender.close()

    def broadcast_update(self, key: str) -> int:
        """Send model ``key`` through a fresh group (:meth:`broadcast_sender`). When the trainer's
        send misses the group's deadline, the engine's side of it is reported too."""
        from rlinfer_core.errors import EngineTimeout

        with self.broadcast_sender() as sender:
            tensors = self.engine.checkpoint_names(trainer_side.to_trainer(self.oracle.named_parameters(key)))
            pending = self.submit(self.engine.update_weights, sender.source(tensors))
            try:
                sender.send(tensors)
            except EngineTimeout as exc:
                raise AssertionError(f"trainer side: {exc}\nengine side: {outcome_of(pending)}") from exc
            return pending.result(timeout=OP_TIMEOUT_S)

    def restore(self) -> None:
        """Serve the base weights again (no-op when already served)."""
        if self.current == BASE:
            return
        transports = self.local_transports()
        assert transports, "weights changed, but no local transport is claimed to restore them"
        self.update(transports[0], BASE)

    def close(self) -> None:
        """Stop the helper threads."""
        self.pool.shutdown(wait=False, cancel_futures=True)
