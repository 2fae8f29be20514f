"""Weight sync over every claimed transport, versioning, and the fault matrix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from rlinfer_conformance import trainer_side
from rlinfer_conformance.world import BASE, CUDA_IPC_TRANSPORTS, LOGPROB_TOLERANCE, OP_TIMEOUT_S, OTHER, KitWorld
from rlinfer_core.errors import EngineTimeout, WeightUpdateError
from rlinfer_core.types import Capability, Completion, GenerateRequest, MemoryTag, SamplingParams
from rlinfer_core.weights import Bucket, BucketManifest, Buckets, CheckpointDir, NamedTensors

__all__ = [
    "test_update_to_second_model",
    "test_update_never_serves_a_prefix_of_the_old_weights",
    "test_transports_give_identical_engines",
    "test_explicit_versions",
    "test_bad_weight_update_keeps_old_weights",
    "test_bench_raw_weight_update",
    "test_gpu_tensors_reach_the_engine_through_cuda_ipc",
    "test_broadcast_that_never_arrives_fails_by_the_deadline",
]

ALL_TRANSPORTS = (
    Capability.WEIGHTS_TENSORS,
    Capability.WEIGHTS_BUCKETS,
    Capability.WEIGHTS_DISK,
    Capability.WEIGHTS_BROADCAST,
)


def _snapshot(world: KitWorld) -> list[Completion]:
    return world.generate(world.greedy_requests(max_tokens=12))


def _same(a: list[Completion], b: list[Completion]) -> float:
    assert [c.token_ids for c in a] == [c.token_ids for c in b], "greedy outputs differ"
    return max(abs(x - y) for ca, cb in zip(a, b, strict=True) for x, y in zip(ca.logprobs, cb.logprobs, strict=True))


@pytest.mark.parametrize(
    "transport",
    [pytest.param(t, marks=pytest.mark.requires(t), id=t.value) for t in ALL_TRANSPORTS],
)
@pytest.mark.hooks("rlinfer_update_weights", "rlinfer_on_weights_updated", "rlinfer_init_weight_broadcast")
def test_update_to_second_model(rlinfer_base_weights: KitWorld, transport: Capability) -> None:
    world = rlinfer_base_weights
    world.generate_and_check(None)  # fills the prefix cache with base-weight KV
    seen = len(world.events.events)
    version = world.update(transport, OTHER)
    name = transport.value.removeprefix("weights.")
    world.generate_and_check(f"after_update_{name}_v{version}")  # equals the second model's argmax
    updated = [e for n, e in world.events.events[seen:] if n == "rlinfer_on_weights_updated"]
    assert updated == [{"version": version, "transport": name}]
    world.update(transport, BASE)
    world.generate_and_check(f"after_update_back_{name}_v{version + 1}")


#: a prompt of several KV blocks (engines cache whole blocks, vLLM of 16 or 128 tokens): the fixed prompts are too
#: short to leave a reusable prefix in the engine's cache
LONG_PROMPT = [1, *(3 + (7 * i) % 97 for i in range(299))]


@pytest.mark.hooks("rlinfer_update_weights")
def test_update_never_serves_a_prefix_of_the_old_weights(rlinfer_base_weights: KitWorld) -> None:
    """The same long prompt before and after updates (to the other model, and back under a new
    version): each answer is the served weights' own, greedy tokens and logprobs, so no prefix the
    old weights computed was reused (the engine resets its prefix cache, or keys it by version)."""
    world = rlinfer_base_weights
    transport = world.local_transports()[0]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    def check(checkpoint: str | None) -> None:
        requests = [GenerateRequest(prompt_token_ids=LONG_PROMPT, sampling=params, request_id=world.request_id())]
        world.check_parity(checkpoint, requests, world.generate(requests))

    check(None)  # fills the prefix cache with the base weights' KV of the prompt
    check(None)  # served from it
    world.update(transport, OTHER)
    check("after_update_long_prompt")
    world.update(transport, BASE)
    check("after_update_back_long_prompt")


@pytest.mark.requires(Capability.WEIGHTS_BUCKETS)
def test_transports_give_identical_engines(rlinfer_base_weights: KitWorld) -> None:
    world = rlinfer_base_weights
    others = [t for t in ALL_TRANSPORTS if t is not Capability.WEIGHTS_BUCKETS and world.supports(t)]
    if not others:
        pytest.skip("only one weight transport is claimed; nothing to compare buckets with")
    world.update(Capability.WEIGHTS_BUCKETS, OTHER)
    reference = _snapshot(world)
    for transport in others:
        world.update(transport, BASE)
        world.update(transport, OTHER)
        delta = _same(reference, _snapshot(world))
        # the same weights: 10x tighter than engine vs oracle (1e-6 at the CPU tolerance)
        assert delta <= LOGPROB_TOLERANCE / 10, f"{transport.value} vs buckets: max |dlogprob| {delta}"
        world.report.record_parity(f"buckets_vs_{transport.value}", delta, 0, 0)


@pytest.mark.requires(Capability.WEIGHTS_TENSORS)
def test_explicit_versions(rlinfer_base_weights: KitWorld) -> None:
    world = rlinfer_base_weights
    engine = world.engine
    start = engine.weight_version
    assert engine.update_weights(world.source(Capability.WEIGHTS_TENSORS, BASE), version=start + 5) == start + 5
    assert engine.weight_version == start + 5
    with pytest.raises(WeightUpdateError):
        engine.update_weights(world.source(Capability.WEIGHTS_TENSORS, BASE), version=start + 5)
    assert engine.weight_version == start + 5
    (c,) = world.generate(world.greedy_requests(max_tokens=2)[:1])
    assert c.weight_version == start + 5


@pytest.mark.parametrize(
    "transport",
    [pytest.param(t, marks=pytest.mark.requires(t), id=t.value) for t in CUDA_IPC_TRANSPORTS],
)
def test_gpu_tensors_reach_the_engine_through_cuda_ipc(rlinfer_base_weights: KitWorld, transport: Capability) -> None:
    world = rlinfer_base_weights
    if not trainer_side.on_gpu():
        pytest.skip("the kit's trainer holds CPU tensors; --rlinfer-trainer-device cuda[:N] runs this on a GPU")
    if world.pooled:
        pytest.skip("a pool's replicas receive tensors through Ray, not CUDA IPC from this process")
    before = world.cuda_ipc_handles
    world.update(transport, OTHER)  # asserts that this update handed out CUDA IPC handles
    world.generate_and_check(f"after_cuda_ipc_{transport.value.removeprefix('weights.')}")
    shared = world.cuda_ipc_handles - before
    assert shared > 0
    world.report.notes.append(f"{transport.value} from {trainer_side.device()}: {shared} CUDA IPC handles")


# --- fault matrix: each case builds a bad update of the SECOND model (so a partial load would
# show in the outputs) and says which capability it needs.


def _tensors(world: KitWorld) -> list[tuple[str, Any]]:
    return world.oracle.named_parameters(OTHER)


def _unknown_name(w: KitWorld) -> Any:
    return NamedTensors.of([*_tensors(w), ("model.layers.99.mlp.up_proj.weight", _tensors(w)[0][1])])


def _wrong_shape(w: KitWorld) -> Any:
    t = _tensors(w)
    t[-1] = (t[-1][0], t[-1][1][:-1])
    return NamedTensors.of(t)


def _wrong_dtype(w: KitWorld) -> Any:
    t = _tensors(w)
    t[-1] = (t[-1][0], t[-1][1].to(__import__("torch").float16))
    return NamedTensors.of(t)


def _poison(value: float) -> Callable[[KitWorld], Any]:
    def make(w: KitWorld) -> Any:
        t = _tensors(w)
        t[-1][1].view(-1)[7] = value
        # on the kit's trainer device: a backend may check the values of CUDA tensors itself
        return NamedTensors.of(trainer_side.to_trainer(t))

    return make


def _duplicate(w: KitWorld) -> Any:
    t = _tensors(w)
    return NamedTensors.of([*t, t[0]])


def _empty(w: KitWorld) -> Any:
    return NamedTensors.of([])


def _truncated_bucket(w: KitWorld) -> Any:
    buckets = list(w.source(Capability.WEIGHTS_BUCKETS, OTHER).buckets)  # type: ignore[union-attr]
    last = buckets[-1]
    buckets[-1] = Bucket(last.manifest, last.data[: last.manifest.nbytes // 2].clone())
    return Buckets(buckets)


def _corrupt_bucket(w: KitWorld) -> Any:
    """Buckets whose checksum no longer matches their bytes (checksums made here: buckets packed
    on a GPU, as on the kit's CUDA trainer device, carry none by default)."""
    from rlinfer_core.transfer.buckets import checksum

    buckets = [
        Bucket(attrs.evolve(b.manifest, checksum=checksum(b.data, b.manifest.nbytes)), b.data)
        for b in w.source(Capability.WEIGHTS_BUCKETS, OTHER).buckets  # type: ignore[union-attr]
    ]
    last = buckets[-1]
    data = last.data.clone()
    data[3] ^= 0x5A
    return Buckets([*buckets[:-1], Bucket(last.manifest, data)])


def _lying_manifest(w: KitWorld) -> Any:
    buckets = list(w.source(Capability.WEIGHTS_BUCKETS, OTHER).buckets)  # type: ignore[union-attr]
    m = buckets[0].manifest
    entries = list(m.entries)
    e = entries[0]
    entries[0] = type(e)(e.name, e.dtype, e.shape, e.offset + 4, e.nbytes)
    buckets[0] = Bucket(BucketManifest(m.dtype, m.nbytes, tuple(entries), m.checksum), buckets[0].data)
    return Buckets(buckets)


def _corrupt_file(w: KitWorld) -> Any:
    path = w.tmp / "ckpt-corrupt"
    path.mkdir(exist_ok=True)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + b"\0" * 64)
    return CheckpointDir(str(path))


def _nan_dir(w: KitWorld) -> Any:
    """A well-formed checkpoint with one NaN: the facade reads headers only, the engine side
    must refuse it before loading anything."""
    from rlinfer_core.transfer.disk import save_dir

    tensors = _poison(float("nan"))(w).tensors
    return CheckpointDir(str(save_dir(list(tensors), w.tmp / "ckpt-nan")))


def _missing_dir(w: KitWorld) -> Any:
    return CheckpointDir(str(w.tmp / "does-not-exist"))


FAULTS: dict[str, tuple[Capability, Callable[[KitWorld], Any]]] = {
    "unknown_name": (Capability.WEIGHTS_TENSORS, _unknown_name),
    "wrong_shape": (Capability.WEIGHTS_TENSORS, _wrong_shape),
    "wrong_dtype": (Capability.WEIGHTS_TENSORS, _wrong_dtype),
    "nan": (Capability.WEIGHTS_TENSORS, _poison(float("nan"))),
    "inf": (Capability.WEIGHTS_TENSORS, _poison(float("inf"))),
    "duplicate_name": (Capability.WEIGHTS_TENSORS, _duplicate),
    "empty": (Capability.WEIGHTS_TENSORS, _empty),
    "truncated_bucket": (Capability.WEIGHTS_BUCKETS, _truncated_bucket),
    "corrupt_bucket_checksum": (Capability.WEIGHTS_BUCKETS, _corrupt_bucket),
    "inconsistent_manifest": (Capability.WEIGHTS_BUCKETS, _lying_manifest),
    "corrupt_safetensors": (Capability.WEIGHTS_DISK, _corrupt_file),
    "disk_nan": (Capability.WEIGHTS_DISK, _nan_dir),
    "missing_checkpoint_dir": (Capability.WEIGHTS_DISK, _missing_dir),
    "broadcast_nan": (Capability.WEIGHTS_BROADCAST, _poison(float("nan"))),
    "update_while_released": (Capability.MEMORY_RELEASE, lambda w: None),
}


def _apply_fault(world: KitWorld, case: str) -> None:
    if case == "broadcast_nan":
        import unittest.mock

        poisoned = FAULTS[case][1](world).tensors
        with unittest.mock.patch.object(world.oracle, "named_parameters", lambda key: list(poisoned)):
            world.broadcast_update(OTHER)
    elif case == "update_while_released":
        world.engine.release_memory([MemoryTag.WEIGHTS])
        try:
            world.engine.update_weights(world.source(world.local_transports()[0], OTHER))
        finally:
            world.engine.resume_memory([MemoryTag.WEIGHTS])
    else:
        world.engine.update_weights(FAULTS[case][1](world))


@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=pytest.mark.requires(cap), id=name) for name, (cap, _) in FAULTS.items()]
)
@pytest.mark.hooks("rlinfer_on_weight_update_failed")
def test_bad_weight_update_keeps_old_weights(rlinfer_base_weights: KitWorld, case: str) -> None:
    world = rlinfer_base_weights
    before = _snapshot(world)
    version = world.engine.weight_version
    seen = len(world.events.events)
    with pytest.raises(WeightUpdateError):
        _apply_fault(world, case)
    assert world.engine.weight_version == version, "a failed update must not bump the version"
    world.engine.check_health()
    after = _snapshot(world)
    _same(before, after)
    assert "rlinfer_on_weight_update_failed" in world.events.names()[seen:]
    world.generate_and_check(None)  # and they are still the base model's weights


@pytest.mark.requires(Capability.BENCH)
@pytest.mark.hooks("rlinfer_bench_raw_weight_update")
def test_bench_raw_weight_update(rlinfer_base_weights: KitWorld) -> None:
    world = rlinfer_base_weights
    version = world.engine.weight_version
    world.engine.bench_raw_weight_update(str(world.oracle.model_dir(OTHER)))
    world.current = OTHER
    assert world.engine.weight_version == version, "the raw (bench) path does not version weights"
    if world.supports(Capability.PREFIX_CACHE_RESET):
        world.engine.reset_prefix_cache()  # the raw path leaves the cache to the caller
    world.generate_and_check(None)


#: the group's timeout_s in the test of a broadcast that never arrives (the engine's deadline)
SILENT_TRAINER_TIMEOUT_S = 3.0


@pytest.mark.requires(Capability.WEIGHTS_BROADCAST)
@pytest.mark.hooks("rlinfer_update_weights", "rlinfer_init_weight_broadcast")
def test_broadcast_that_never_arrives_fails_by_the_deadline(rlinfer_base_weights: KitWorld) -> None:
    """A trainer that joins the weight group but never sends: the engine's update ends with a
    typed error by the group's deadline (no rank waits without one), the engine serves the
    weights and version it had, and the next broadcast update (a new group) lands."""
    import time

    world = rlinfer_base_weights
    before = world.engine.weight_version
    with world.broadcast_sender(timeout_s=SILENT_TRAINER_TIMEOUT_S) as sender:
        tensors = world.engine.checkpoint_names(world.oracle.named_parameters(OTHER))
        started = time.monotonic()
        pending = world.submit(world.engine.update_weights, sender.source(tensors))
        with pytest.raises((WeightUpdateError, EngineTimeout)) as failed:
            pending.result(timeout=OP_TIMEOUT_S)
        waited = time.monotonic() - started
    assert waited < SILENT_TRAINER_TIMEOUT_S + 30, (
        f"the engine waited {waited:.1f} s for a {SILENT_TRAINER_TIMEOUT_S} s group"
    )
    assert "did not arrive" in str(failed.value), failed.value
    assert world.engine.weight_version == before
    world.generate_and_check("after_broadcast_that_never_arrived")
    world.update(Capability.WEIGHTS_BROADCAST, OTHER)
