"""A long greedy stream in the background, for tests that change weights while it runs."""

from __future__ import annotations

import threading
from typing import Any

from rlinfer_conformance.world import KitWorld
from rlinfer_core.types import Completion, CompletionDelta, FinishReason, GenerateRequest, SamplingParams


def stream_in_background(world: KitWorld, tag: str) -> tuple[GenerateRequest, threading.Event, Any]:
    """A greedy request as long as the context allows, streamed in a helper thread: the request,
    an event set at its first token, and the future of its deltas."""
    request = GenerateRequest(
        prompt_token_ids=world.prompts()[0],
        sampling=SamplingParams(temperature=0.0, max_tokens=world.max_model_len - 40, ignore_eos=True),
        request_id=world.request_id(tag),
    )
    first = threading.Event()

    def consume() -> list[CompletionDelta]:
        deltas = []
        for delta in world.engine.stream(request):
            deltas.append(delta)
            if delta.token_ids:
                first.set()
        return deltas

    return request, first, world.submit(consume)


def joined(request: GenerateRequest, deltas: list[CompletionDelta]) -> Completion:
    """The streamed deltas of ``request`` as one Completion; every token carries its version."""
    tokens = tuple(t for d in deltas for t in d.token_ids)
    versions = tuple(v for d in deltas for v in (d.token_versions or ()))
    assert len(versions) == len(tokens), "every streamed token carries its weight version"
    assert request.prompt_token_ids is not None
    return Completion(
        request_id=request.request_id,
        index=0,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=tokens,
        logprobs=tuple(x for d in deltas for x in d.logprobs),
        finish_reason=deltas[-1].finish_reason or FinishReason.ABORT,
        token_versions=versions,
        weight_version=deltas[-1].weight_version,
    )
