"""release_memory / resume_memory: outputs unchanged, memory really freed where claimed."""

from __future__ import annotations

import pytest

from rlinfer_conformance.world import KitWorld
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.preflight import releasable_memory_tags
from rlinfer_core.types import Capability, GenerateRequest, MemoryTag

__all__ = [
    "test_release_cuda_graphs_frees_their_memory_and_keeps_outputs",
    "test_release_resume_keeps_outputs",
    "test_release_tags_one_by_one",
]


#: release_memory must free at least this share of the memory the engine holds
MIN_FREED_SHARE = 0.9


def _device_bytes(world: KitWorld) -> tuple[int, int] | None:
    """(free, total) bytes of the accelerator, or None off CUDA."""
    if world.engine.capabilities.platform != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def _engine_bytes(world: KitWorld, free: int, total: int) -> int:
    """What the engine holds for its weights and KV cache: the served weights (from its weight
    specs) plus the configured KV budget; without a KV budget (gpu_memory_utilization), the device
    memory in use, which also counts CUDA contexts and is the stricter bound."""
    from rlinfer_core.transfer.buckets import to_dtype

    kv = world.engine.config.kv_cache_memory_bytes
    if kv is None:
        return total - free
    weights = sum(s.numel * to_dtype(s.dtype).itemsize for s in world.engine.weight_specs.values())
    return weights + kv


@pytest.mark.requires(Capability.MEMORY_RELEASE)
@pytest.mark.hooks(
    "rlinfer_release_memory", "rlinfer_resume_memory", "rlinfer_on_memory_released", "rlinfer_on_memory_resumed"
)
def test_release_resume_keeps_outputs(rlinfer_world: KitWorld) -> None:
    before = rlinfer_world.generate_and_check(None)
    device_before = _device_bytes(rlinfer_world)
    rlinfer_world.engine.release_memory()
    try:
        device_released = _device_bytes(rlinfer_world)
        if device_before is not None and device_released is not None:
            freed = device_released[0] - device_before[0]
            held = _engine_bytes(rlinfer_world, *device_before)
            rlinfer_world.report.timings["memory_freed_bytes"] = float(freed)
            rlinfer_world.report.timings["memory_freed_share"] = freed / held
            assert freed >= MIN_FREED_SHARE * held, (
                f"release_memory freed {freed / 2**20:.1f} MiB of the {held / 2**20:.1f} MiB the engine holds "
                f"for weights and KV cache ({freed / held:.0%} < {MIN_FREED_SHARE:.0%})"
            )
        assert rlinfer_world.engine.released == releasable_memory_tags(rlinfer_world.engine.capabilities)
        with pytest.raises(InvalidRequest):
            rlinfer_world.engine.generate([GenerateRequest(prompt_token_ids=[1, 2])])
    finally:
        rlinfer_world.engine.resume_memory()
    after = rlinfer_world.generate_and_check("after_release_resume")
    assert [c.token_ids for c in before] == [c.token_ids for c in after]
    names = rlinfer_world.events.names()
    assert "rlinfer_on_memory_released" in names and "rlinfer_on_memory_resumed" in names


@pytest.mark.requires(Capability.MEMORY_RELEASE)
def test_release_tags_one_by_one(rlinfer_world: KitWorld) -> None:
    for tag in sorted(releasable_memory_tags(rlinfer_world.engine.capabilities)):
        rlinfer_world.engine.release_memory([tag])
        rlinfer_world.engine.resume_memory([tag])
        rlinfer_world.generate_and_check(f"after_release_resume_{tag.value}", max_tokens=6)


@pytest.mark.requires(Capability.MEMORY_RELEASE, Capability.MEMORY_CUDA_GRAPH)
def test_release_cuda_graphs_frees_their_memory_and_keeps_outputs(rlinfer_world: KitWorld) -> None:
    before = rlinfer_world.generate_and_check(None, max_tokens=6)
    device_before = _device_bytes(rlinfer_world)
    rlinfer_world.engine.release_memory([MemoryTag.CUDA_GRAPH])
    try:
        assert rlinfer_world.engine.released == {MemoryTag.CUDA_GRAPH}
        device_released = _device_bytes(rlinfer_world)
        assert device_before is not None and device_released is not None, "CUDA graphs live on CUDA"
        freed = device_released[0] - device_before[0]
        rlinfer_world.report.timings["cuda_graph_freed_bytes"] = float(freed)
        assert freed > 0, f"releasing the CUDA graphs freed {freed} bytes"
    finally:
        rlinfer_world.engine.resume_memory([MemoryTag.CUDA_GRAPH])
    after = rlinfer_world.generate_and_check("after_cuda_graph_release", max_tokens=6)
    assert [c.token_ids for c in before] == [c.token_ids for c in after]
