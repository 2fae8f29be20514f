"""The kit's property test on an engine that stopped answering: one timeout, not one per example
that hypothesis tries while shrinking (which looked like a hang on 2 GPUs, session 13)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinfer_conformance.world import generate_unless_wedged
from rlinfer_core.errors import EngineTimeout


class WedgedWorldDouble:
    """Test double of the kit's world whose engine times out on every generate."""

    def __init__(self) -> None:
        self.calls = 0

    def generate(self, requests: Any) -> Any:
        """Count the call, then time out."""
        self.calls += 1
        raise EngineTimeout("generate timed out")


def test_a_wedged_engine_is_called_once_while_hypothesis_shrinks() -> None:
    world = WedgedWorldDouble()
    wedged: list[BaseException] = []

    @settings(max_examples=20, database=None, deadline=None)
    @given(st.lists(st.integers(0, 100), min_size=1, max_size=5))
    def prop(requests: list[int]) -> None:
        generate_unless_wedged(world, requests, wedged)  # type: ignore[arg-type]

    with pytest.raises(EngineTimeout, match="generate timed out") as failed:
        prop()
    assert world.calls == 1
    assert any("without calling the engine" in note for note in getattr(failed.value, "__notes__", []))
