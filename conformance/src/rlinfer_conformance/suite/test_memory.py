"""release_memory / resume_memory: outputs unchanged, memory really freed where claimed."""

from __future__ import annotations

import pytest
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import Capability, GenerateRequest, MemoryTag

from rlinfer_conformance.world import KitWorld

__all__ = ["test_release_resume_keeps_outputs", "test_release_tags_one_by_one"]


def _free_bytes(world: KitWorld) -> int | None:
    if world.engine.capabilities.platform != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


@pytest.mark.requires(Capability.MEMORY_RELEASE)
@pytest.mark.hooks(
    "rlinfer_release_memory", "rlinfer_resume_memory", "rlinfer_on_memory_released", "rlinfer_on_memory_resumed"
)
def test_release_resume_keeps_outputs(rlinfer_world: KitWorld) -> None:
    before = rlinfer_world.generate_and_check(None)
    free_before = _free_bytes(rlinfer_world)
    rlinfer_world.engine.release_memory()
    try:
        free_released = _free_bytes(rlinfer_world)
        if free_before is not None and free_released is not None:
            freed = free_released - free_before
            rlinfer_world.report.timings["memory_freed_bytes"] = float(freed)
            assert freed > 0, "release_memory is claimed but freed no accelerator memory"
        assert rlinfer_world.engine.async_engine.released == frozenset(MemoryTag)
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
    for tag in (MemoryTag.KV_CACHE, MemoryTag.WEIGHTS):
        rlinfer_world.engine.release_memory([tag])
        rlinfer_world.engine.resume_memory([tag])
        rlinfer_world.generate_and_check(f"after_release_resume_{tag.value}", max_tokens=6)
