"""Negative contract: every capability a backend does not claim raises UnsupportedCapability."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rlinfer_conformance.world import BASE, KitWorld
from rlinfer_core.errors import UnsupportedCapability
from rlinfer_core.scoring import ScoreRequest
from rlinfer_core.types import (
    Capability,
    ChatMessage,
    GenerateRequest,
    MemoryTag,
    PauseMode,
    SamplingParams,
)
from rlinfer_core.weights import BroadcastGroup, BroadcastSource, WeightDelta, specs_of

__all__ = ["test_unsupported_capability_raises"]


def _gen(**sampling: Any) -> Callable[[KitWorld], Any]:
    return lambda w: w.engine.generate([GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(**sampling))])


def _stream(w: KitWorld) -> Any:
    return list(w.engine.stream(GenerateRequest(prompt_token_ids=[1, 2])))


def _broadcast(w: KitWorld) -> Any:
    with pytest.raises(UnsupportedCapability):
        w.engine.init_weight_broadcast(BroadcastGroup("127.0.0.1", 29999))
    return w.engine.update_weights(BroadcastSource(specs_of(w.oracle.named_parameters(BASE))))


def _bench(w: KitWorld) -> Any:
    with pytest.raises(UnsupportedCapability):
        w.engine.bench_raw_weight_update(str(w.oracle.model_dir(BASE)))
    return w.engine.bench_raw_generate([GenerateRequest(prompt_token_ids=[1, 2])])


def _deterministic(w: KitWorld) -> Any:
    """Refused before any engine process starts."""
    import attrs

    from rlinfer_core.engine import open_engine

    return open_engine(w.backend, attrs.evolve(w.engine.config, deterministic=True))


def _images(w: KitWorld) -> Any:
    """A prompt with an image (the session's text model, or a backend without image input)."""
    from rlinfer_core.tiny_vlm import tiny_image

    return w.engine.generate([GenerateRequest(prompt_token_ids=[1, 2], images=[tiny_image()])])


def _quantized_reload(w: KitWorld) -> Any:
    """An engine quantizing online (engine_kwargs quantization="fp8") is refused before it starts."""
    import attrs

    from rlinfer_core.engine import open_engine

    config = w.engine.config
    return open_engine(w.backend, attrs.evolve(config, engine_kwargs={**config.engine_kwargs, "quantization": "fp8"}))


PROBES: dict[Capability, Callable[[KitWorld], Any]] = {
    Capability.STREAM: _stream,
    Capability.CHAT: lambda w: w.engine.generate([GenerateRequest(messages=[ChatMessage("user", "hello")])]),
    Capability.PROMPT_LOGPROBS: _gen(prompt_logprobs=True),
    Capability.TOP_LOGPROBS: _gen(logprobs=2),
    Capability.MULTI_SAMPLE: _gen(n=2),
    Capability.SEEDED_SAMPLING: _gen(temperature=1.0, seed=3),
    Capability.STOP_STRINGS: _gen(stop=("x",)),
    Capability.ABORT: lambda w: w.engine.abort(["no-such-request"]),
    Capability.PAUSE_ABORT: lambda w: w.engine.pause(PauseMode.ABORT),
    Capability.PAUSE_WAIT: lambda w: w.engine.pause(PauseMode.WAIT),
    Capability.PAUSE_KEEP: lambda w: w.engine.pause(PauseMode.KEEP),
    Capability.WEIGHTS_TENSORS: lambda w: w.engine.update_weights(w.source(Capability.WEIGHTS_TENSORS, BASE)),
    Capability.WEIGHTS_BUCKETS: lambda w: w.engine.update_weights(w.source(Capability.WEIGHTS_BUCKETS, BASE)),
    Capability.WEIGHTS_DISK: lambda w: w.engine.update_weights(w.source(Capability.WEIGHTS_DISK, BASE)),
    Capability.WEIGHTS_BROADCAST: _broadcast,
    Capability.MEMORY_RELEASE: lambda w: w.engine.release_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE]),
    Capability.MEMORY_DISCARD_WEIGHTS: lambda w: w.engine.release_memory(discard_weights=True),
    Capability.WEIGHTS_DELTA: lambda w: w.engine.update_weights(
        WeightDelta(w.engine.weight_version, w.oracle.named_parameters(w.current)[:1])
    ),
    Capability.WEIGHTS_STAGED: lambda w: w.engine.stage_weights(w.source(Capability.WEIGHTS_TENSORS, BASE)),
    Capability.DETERMINISTIC: _deterministic,
    Capability.GENERATE_ROUTED_EXPERTS: _gen(return_routed_experts=True),
    Capability.GENERATE_HIDDEN_STATES: _gen(return_hidden_states=True),
    Capability.PREFIX_CACHE_RESET: lambda w: w.engine.reset_prefix_cache(),
    Capability.WEIGHTS_CHECKSUM: lambda w: w.engine.verify_weights(w.oracle.named_parameters(BASE)),
    Capability.SAMPLING_MIN_P: _gen(temperature=1.0, min_p=0.1),
    Capability.SAMPLING_PENALTIES: _gen(repetition_penalty=1.2),
    Capability.SAMPLING_LOGIT_BIAS: _gen(logit_bias={3: 1.0}),
    Capability.LOGPROBS_RAW: _gen(logprobs_mode="raw"),
    Capability.LOGPROBS_PROCESSED: _gen(temperature=1.0, top_p=0.5),
    Capability.BENCH: _bench,
    Capability.SESSIONS: lambda w: w.engine.session([{"role": "user", "content": "hello"}]),
    Capability.SCORE: lambda w: w.engine.score([ScoreRequest([1, 2], [3])]),
    Capability.TOOLS: lambda w: w.engine.generate([GenerateRequest(prompt_token_ids=[1, 2], tool_parser="hermes")]),
    Capability.STRUCTURED: _gen(structured={"choice": ["a", "b"]}),
    Capability.STOP_REGEX: _gen(stop_regex=("x+",)),
    Capability.GRAMMAR_EBNF: _gen(structured={"ebnf": 'root ::= "a"'}),
    Capability.PRIORITY: lambda w: w.engine.generate([GenerateRequest(prompt_token_ids=[1, 2], priority=1)]),
    Capability.LORA: lambda w: w.engine.list_loras(),
    Capability.MEMORY_CUDA_GRAPH: lambda w: w.engine.release_memory(["cuda_graph"]),
    Capability.WEIGHTS_QUANTIZED_RELOAD: _quantized_reload,
    Capability.MULTIMODAL: _images,
}


@pytest.mark.parametrize(
    "capability", [pytest.param(c, marks=pytest.mark.unsupported(c), id=c.value) for c in Capability]
)
def test_unsupported_capability_raises(rlinfer_world: KitWorld, capability: Capability) -> None:
    version = rlinfer_world.engine.weight_version
    with pytest.raises(UnsupportedCapability) as info:
        PROBES[capability](rlinfer_world)
    assert info.value.capability == capability.value
    assert info.value.backend == rlinfer_world.backend
    assert rlinfer_world.engine.weight_version == version
    rlinfer_world.generate_and_check(None, max_tokens=4)  # still serving, same weights
