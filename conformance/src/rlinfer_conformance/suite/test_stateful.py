"""A stateful hypothesis machine: generate / update / release / resume / abort, against the oracle."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from rlinfer_conformance.checks import check_batch
from rlinfer_conformance.world import BASE, OTHER, KitWorld
from rlinfer_core.errors import InvalidRequest, WeightUpdateError
from rlinfer_core.preflight import releasable_memory_tags
from rlinfer_core.types import Capability, GenerateRequest, MemoryTag, SamplingParams

__all__ = ["test_state_machine"]

STATEFUL = {"ci": (3, 6), "thorough": (20, 15)}  # (max_examples, steps)


def machine_for(world: KitWorld) -> type[RuleBasedStateMachine]:
    """A machine class bound to the session's engine."""
    transports = world.local_transports()
    releasable = world.supports(Capability.MEMORY_RELEASE)
    abortable = world.supports(Capability.ABORT)

    class EngineMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            world.restore()
            if releasable:
                world.engine.resume_memory()
            self.version = world.engine.weight_version
            self.released: set[MemoryTag] = set()

        @rule(prompt=st.lists(st.integers(3, 300), min_size=1, max_size=12), max_tokens=st.integers(1, 10))
        def generate(self, prompt: list[int], max_tokens: int) -> None:
            request = GenerateRequest(
                prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens)
            )
            if self.released:
                with pytest.raises(InvalidRequest):
                    world.generate([request])
                return
            completions = world.generate([request])
            check_batch(world, [request], completions)
            world.check_parity(None, [request], completions)
            assert completions[0].weight_version == self.version

        @precondition(lambda self: bool(transports))
        @rule(key=st.sampled_from([BASE, OTHER]), index=st.integers(0, 2))
        def update(self, key: str, index: int) -> None:
            transport = transports[index % len(transports)]
            if MemoryTag.WEIGHTS in self.released:
                with pytest.raises(WeightUpdateError):
                    world.engine.update_weights(world.source(transport, key))
                return
            world.update(transport, key)
            self.version += 1

        @precondition(lambda self: releasable)
        @rule(tag=st.sampled_from(sorted(releasable_memory_tags(world.engine.capabilities))))
        def release(self, tag: MemoryTag) -> None:
            world.engine.release_memory([tag])
            self.released.add(tag)

        @precondition(lambda self: releasable)
        @rule()
        def resume(self) -> None:
            world.engine.resume_memory()
            self.released.clear()

        @precondition(lambda self: abortable)
        @rule()
        def abort_nothing(self) -> None:
            world.engine.abort(None)  # nothing in flight: a no-op

        @invariant()
        def version_matches(self) -> None:
            assert world.engine.weight_version == self.version

        def teardown(self) -> None:
            if releasable:
                world.engine.resume_memory()
            world.restore()

    return EngineMachine


def test_state_machine(rlinfer_world: KitWorld) -> None:
    examples, steps = STATEFUL.get(rlinfer_world.report.profile, STATEFUL["ci"])
    machine = machine_for(rlinfer_world)
    run_state_machine_as_test(machine, settings=settings(max_examples=examples, stateful_step_count=steps))
    rlinfer_world.generate_and_check("after_state_machine")
