"""``weights.quantized_reload``: FP8 rollout from BF16 training. An engine that quantizes online
(``engine_kwargs={"quantization": "fp8"}``) keeps the checkpoint's weight specs and serves the BF16
tensors a trainer sends. FP8 is not exact, so parity with the oracle is not asserted to the kit's
tolerance; what is asserted is behaviour: the engine serves whichever policy it was sent (its
logprobs lie closer to that policy's oracle than to the other one's), and sending the first
policy again brings its logprobs back."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

from rlinfer_conformance.world import BASE, OTHER, KitWorld
from rlinfer_core.types import Capability
from rlinfer_core.weights import NamedTensors

__all__ = ["test_fp8_engine_serves_bf16_updates"]


def _oracle_logprobs(world: KitWorld, key: str, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    logits = world.oracle.logits(key, [*prompt, *tokens]).log_softmax(-1)
    return [float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def _distance(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    diffs = [abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return sum(diffs) / len(diffs)


@pytest.mark.requires(Capability.WEIGHTS_QUANTIZED_RELOAD)
@pytest.mark.hooks("rlinfer_weight_specs", "rlinfer_update_weights")
def test_fp8_engine_serves_bf16_updates(rlinfer_base_weights: KitWorld) -> None:
    from rlinfer_core.engine import open_engine
    from rlinfer_core.scoring import ScoreRequest
    from rlinfer_core.transfer.buckets import to_dtype

    world = rlinfer_base_weights
    base_config = world.engine.config
    kwargs = {**base_config.engine_kwargs, "quantization": "fp8"}
    engine = open_engine(world.backend, attrs.evolve(base_config, dtype="bfloat16", engine_kwargs=kwargs))
    try:
        specs = engine.weight_specs
        checkpoint = dict(world.oracle.named_parameters(BASE))
        assert set(specs) == set(world.engine.weight_specs), "an FP8 engine's weight specs are the checkpoint's"
        assert all(tuple(specs[n].shape) == tuple(checkpoint[n].shape) for n in specs if n in checkpoint)
        assert not [n for n, s in specs.items() if "float8" in s.dtype], "the trainer sends BF16, not FP8"

        prompts = [p for p in world.prompts() if len(p) > 1][:3]
        continuations = [world.oracle.greedy(BASE, p, 12) for p in prompts]
        requests = [ScoreRequest(p, c) for p, c in zip(prompts, continuations, strict=True)]
        oracle = {
            key: [_oracle_logprobs(world, key, p, c) for p, c in zip(prompts, continuations, strict=True)]
            for key in (BASE, OTHER)
        }

        def served() -> list[list[float]]:
            return [list(s.logprobs) for s in engine.score(requests)]

        def update(key: str) -> None:
            tensors = [(n, t.to(to_dtype(specs[n].dtype))) for n, t in world.oracle.named_parameters(key) if n in specs]
            engine.update_weights(NamedTensors.of(tensors))

        first = served()
        assert _distance(first, oracle[BASE]) < _distance(first, oracle[OTHER]), "the FP8 engine does not serve BASE"
        update(OTHER)
        other = served()
        assert _distance(other, oracle[OTHER]) < _distance(other, oracle[BASE]), "the BF16 update was not served"
        update(BASE)
        again = served()
        assert _distance(again, oracle[BASE]) < _distance(again, oracle[OTHER])
        # the same weights quantized again give the same FP8 weights: the logprobs come back
        assert _distance(again, first) < 0.1 * _distance(first, oracle[OTHER])
    finally:
        engine.shutdown()
