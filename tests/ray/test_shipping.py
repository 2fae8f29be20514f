"""ShippedWeights: the pool's weight updates go through Ray's object store as raw bytes, out of band."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlinfer_core.transfer.buckets import as_bytes, checksum, pack, unpack_all
from rlinfer_core.weights import Buckets, NamedTensors
from rlinfer_ray.shipping import ShippedWeights


def sample_tensors() -> NamedTensors:
    big = torch.randn(256, 512).to(torch.bfloat16)  # 256 KiB
    return NamedTensors(
        (
            ("big.bf16", big),
            ("f32", torch.randn(3, 5)),
            ("transposed", torch.randn(4, 6).t()),  # not contiguous
            ("mask", torch.tensor([True, False, True])),
            ("ids", torch.arange(7, dtype=torch.int64)),
            ("scalar", torch.tensor(2.5)),
            ("empty", torch.zeros(0, 4)),
        )
    )


def digest(tensor: torch.Tensor) -> str:
    raw = as_bytes(tensor)
    return checksum(raw, raw.numel())


def assert_same(got: NamedTensors, want: NamedTensors) -> None:
    assert [name for name, _ in got.tensors] == [name for name, _ in want.tensors]
    for (name, g), (_, w) in zip(got.tensors, want.tensors, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.device.type == "cpu"
        assert torch.equal(g, w), name


def test_tensor_bytes_travel_out_of_band() -> None:
    """Under pickle protocol 5 (Ray's), the tensors' bytes leave the pickle as buffers: what Ray
    stores without a copy. A plain NamedTensors keeps them in the pickle."""
    source = sample_tensors()
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(ShippedWeights(source), protocol=5, buffer_callback=buffers.append)
    nbytes = sum(t.numel() * t.element_size() for _, t in source.tensors)
    assert len(payload) < 4096 < nbytes
    assert sum(memoryview(b).nbytes for b in buffers) == nbytes
    in_band: list[pickle.PickleBuffer] = []
    assert len(pickle.dumps(source, protocol=5, buffer_callback=in_band.append)) > 256 * 1024
    assert_same(pickle.loads(payload, buffers=buffers), source)


def test_buckets_round_trip() -> None:
    source = sample_tensors()
    buckets = Buckets(tuple(pack(source.tensors, max_bucket_bytes=64 * 1024)))
    got = pickle.loads(pickle.dumps(ShippedWeights(buckets), protocol=5))
    assert isinstance(got, Buckets) and len(got.buckets) == len(buckets.buckets) > 1
    assert [b.manifest for b in got.buckets] == [b.manifest for b in buckets.buckets]
    assert_same(NamedTensors(tuple(unpack_all(got.buckets))), NamedTensors(tuple(unpack_all(buckets.buckets))))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def test_a_remote_reader_gets_the_named_tensors(local_ray: Any) -> None:
    """What a replica's update_weights receives when the pool passes it the object reference."""
    source = sample_tensors()
    ref = local_ray.put(ShippedWeights(source))

    @local_ray.remote(num_cpus=0)  # the session's pool may hold every CPU of the local Ray
    def read(value: Any) -> tuple[str, list[tuple[str, str, tuple[int, ...], str]]]:
        # runs on a Ray worker, which can import rlinfer_core but not this test module
        from rlinfer_core.transfer.buckets import as_bytes, checksum

        return type(value).__name__, [
            (n, str(t.dtype), tuple(t.shape), checksum(as_bytes(t), as_bytes(t).numel())) for n, t in value.tensors
        ]

    kind, seen = local_ray.get(read.remote(ref), timeout=120)
    assert kind == "NamedTensors"
    assert seen == [(n, str(t.dtype), tuple(t.shape), digest(t)) for n, t in source.tensors]
    assert_same(local_ray.get(ref, timeout=60), source)
