"""``EngineConfig(deterministic=True)``: bitwise-identical tokens and logprobs run to run and
whatever else shares the batch (the engines' batch-invariant modes; GPU engines in practice)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

from rlinfer_conformance.world import KitWorld
from rlinfer_core.types import Capability, Completion, GenerateRequest, SamplingParams

__all__ = ["test_deterministic_across_runs_and_batch_compositions"]


def _signature(completion: Completion) -> tuple[tuple[int, ...], tuple[float, ...]]:
    return tuple(completion.token_ids), tuple(completion.logprobs)


@pytest.mark.requires(Capability.DETERMINISTIC)
@pytest.mark.hooks("rlinfer_start")
def test_deterministic_across_runs_and_batch_compositions(rlinfer_base_weights: KitWorld) -> None:
    from rlinfer_core.engine import open_engine

    world = rlinfer_base_weights
    config = attrs.evolve(world.engine.config, deterministic=True)
    engine = open_engine(world.backend, config)
    try:
        prompts = world.prompts()
        target = prompts[1]
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=11)
        kinds = [greedy, sampled] if engine.capabilities.supports(Capability.SEEDED_SAMPLING) else [greedy]

        def run(params: SamplingParams, others: Sequence[list[int]]) -> Completion:
            requests = [GenerateRequest(prompt_token_ids=target, sampling=params)]
            # other requests of other lengths change the batch's shape around the target
            requests += [
                GenerateRequest(prompt_token_ids=p, sampling=SamplingParams(temperature=1.0, max_tokens=8 + 5 * i))
                for i, p in enumerate(others)
            ]
            return engine.generate(requests)[0]

        crowd = [p for p in prompts if p != target] * 3
        for params in kinds:
            alone = run(params, [])
            assert len(alone.token_ids) == 24  # premise: a full-length sample to compare
            assert _signature(run(params, [])) == _signature(alone), "two runs of one request differ"
            assert _signature(run(params, crowd)) == _signature(alone), "the request changed inside a bigger batch"
            assert _signature(run(params, crowd[:2])) == _signature(alone), "the request changed in a small batch"
    finally:
        engine.shutdown()
