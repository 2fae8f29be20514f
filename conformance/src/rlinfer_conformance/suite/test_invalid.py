"""Bad input: typed errors before the engine is touched, and the engine keeps serving."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings

from rlinfer_conformance.strategies import invalid_request_makers
from rlinfer_conformance.world import KitWorld
from rlinfer_core.errors import InvalidRequest

__all__ = ["test_invalid_requests_are_rejected", "test_invalid_control_arguments"]

#: invalid requests never reach the engine, so many examples are cheap
INVALID_EXAMPLES = {"ci": 250, "thorough": 2000}


@pytest.mark.hooks("rlinfer_generate")
def test_invalid_requests_are_rejected(rlinfer_world: KitWorld) -> None:
    reference = rlinfer_world.generate_and_check(None, max_tokens=6)
    seen: dict[str, int] = {}

    @settings(max_examples=INVALID_EXAMPLES.get(rlinfer_world.report.profile, 250))
    @given(invalid_request_makers(rlinfer_world.vocab_size, rlinfer_world.max_model_len))
    def prop(case: tuple[str, Callable[[], Any]]) -> None:
        label, make = case
        seen[label] = seen.get(label, 0) + 1
        with pytest.raises(InvalidRequest) as info:
            rlinfer_world.engine.generate(make())
        assert info.value.field, label

    prop()
    after = rlinfer_world.generate_and_check(None, max_tokens=6)
    assert [c.token_ids for c in after] == [c.token_ids for c in reference]
    rlinfer_world.report.notes.append(f"invalid requests rejected: {sum(seen.values())} examples, kinds {seen}")
    assert sum(seen.values()) >= min(200, INVALID_EXAMPLES.get(rlinfer_world.report.profile, 250))


def test_invalid_control_arguments(rlinfer_world: KitWorld) -> None:
    with pytest.raises(InvalidRequest):
        rlinfer_world.engine.pause("sideways")
    with pytest.raises(InvalidRequest):
        rlinfer_world.engine.release_memory(["gpu-ram"])
    with pytest.raises(InvalidRequest):
        rlinfer_world.engine.resume_memory([])
    rlinfer_world.generate_and_check(None, max_tokens=4)
