"""Hidden states out (capability ``generate.hidden_states``): the final-layer hidden states a
request asks for, in rlinfer's one alignment (:mod:`rlinfer_core.hidden_states`), against the HF
oracle's teacher-forced ``last_hidden_state`` (float32).

The test opens an engine of its own with ``EngineConfig(enable_hidden_states=True)`` (a backend
that cannot refuses that at open with UnsupportedCapability, and the test is skipped with the
backend's reason; the session engine's refusal of a request asking for them is
``test_unsupported_capability_raises``). Checked: shapes ``[len(output), hidden]`` and
``[len(prompt), hidden]``, every row against the oracle's at its position, per request in a mixed
batch (n > 1 and sampling included), again on a prefix-cache hit, and after a weight update (the
states follow the weights served).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.report import KitReport
from rlinfer_conformance.world import BASE, LOGPROB_TOLERANCE, OTHER, KitWorld, own_world
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.hidden_states import HiddenStates
from rlinfer_core.types import Capability, Completion, GenerateRequest, SamplingParams

__all__ = ["rlinfer_hidden_states_world", "test_hidden_states_match_the_oracle"]

#: checked on this module's own engine (opened with enable_hidden_states=True), not the session's
OWN_ENGINE_CAPABILITIES = (Capability.GENERATE_HIDDEN_STATES,)

#: max |engine - oracle| over a row, relative to that row's largest oracle magnitude: the logprob
#: tolerance's scale (float32 on CPU; a looser --rlinfer-logprob-tol loosens it too)
HIDDEN_TOLERANCE = max(1e-4, 10 * LOGPROB_TOLERANCE)


@pytest.fixture(scope="module")
def rlinfer_hidden_states_world(
    rlinfer_backend: str,
    rlinfer_config_overrides: dict[str, Any],
    rlinfer_report: KitReport,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[KitWorld]:
    """An engine of its own started able to return hidden states."""
    overrides = {**rlinfer_config_overrides, "enable_hidden_states": True}
    tmp = Path(tmp_path_factory.mktemp("rlinfer-kit-hidden-states"))
    why = f"{Capability.GENERATE_HIDDEN_STATES.value} not supported"
    with own_world(rlinfer_backend, overrides, rlinfer_report, tmp, "llama", "hidden_states", why) as world:
        yield world


def _compare(got: HiddenStates, want: Any, where: str) -> float:
    """Assert ``got`` equals the oracle's rows ``want`` ([rows, hidden] tensor); the worst relative error."""
    import numpy as np

    want = want.numpy()
    assert got.shape == want.shape, f"{where}: shape {got.shape}, expected {want.shape}"
    array = got.array()
    assert not np.isnan(array).any(), f"{where}: rows {got.missing()} missing (NaN)"
    scale = np.maximum(np.abs(want).max(axis=1), 1e-6)
    errors = np.abs(array - want).max(axis=1) / scale
    worst = int(errors.argmax()) if len(errors) else 0
    assert not len(errors) or errors[worst] <= HIDDEN_TOLERANCE, (
        f"{where}: row {worst} differs from the oracle's by {errors[worst]:.3g} of its scale "
        f"(tolerance {HIDDEN_TOLERANCE})"
    )
    return float(errors.max()) if len(errors) else 0.0


def _check(world: KitWorld, completion: Completion, request: GenerateRequest, where: str) -> float:
    """Assert ``completion``'s hidden states against the served weights' oracle."""
    prompt, tokens = list(completion.prompt_token_ids), list(completion.token_ids)
    assert tokens, f"{where}: no tokens"
    assert completion.hidden_states is not None, f"{where}: no hidden_states although the request asked"
    oracle = world.oracle.hidden_states(world.current, [*prompt, *tokens[:-1]])
    worst = _compare(completion.hidden_states, oracle[len(prompt) - 1 :], f"{where} (output)")
    if not request.sampling.prompt_hidden_states:
        assert completion.prompt_hidden_states is None, f"{where}: prompt_hidden_states although not asked"
        return worst
    states = completion.prompt_hidden_states
    assert states is not None, f"{where}: no prompt_hidden_states although the request asked"
    worst = max(worst, _compare(states, oracle[: len(prompt)], f"{where} (prompt)"))
    assert (states.array()[-1] == completion.hidden_states.array()[0]).all(), (
        f"{where}: the last prompt row must be the state that produced the first token"
    )
    return worst


@pytest.mark.hooks("rlinfer_generate", "rlinfer_update_weights")
def test_hidden_states_match_the_oracle(rlinfer_hidden_states_world: KitWorld) -> None:
    world = rlinfer_hidden_states_world
    engine = world.engine
    assert world.supports(Capability.GENERATE_HIDDEN_STATES), (
        "an engine opened with enable_hidden_states=True must claim generate.hidden_states"
    )
    prompts = world.prompts()
    states = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, return_hidden_states=True)
    with_prompt = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, return_hidden_states=True, prompt_hidden_states=True
    )
    samples = 2 if world.supports(Capability.MULTI_SAMPLE) else 1
    sampled = SamplingParams(temperature=1.0, max_tokens=6, n=samples, return_hidden_states=True)
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    requests = [
        GenerateRequest(prompt_token_ids=prompts[0], sampling=states, request_id=world.request_id("hs")),
        GenerateRequest(prompt_token_ids=prompts[1], sampling=with_prompt, request_id=world.request_id("hs")),
        GenerateRequest(prompt_token_ids=prompts[4], sampling=sampled, request_id=world.request_id("hs")),
        GenerateRequest(prompt_token_ids=prompts[5], sampling=with_prompt, request_id=world.request_id("hs")),
        GenerateRequest(prompt_token_ids=prompts[2], sampling=plain, request_id=world.request_id("hs")),
    ]
    first = world.generate(requests)
    by_request = {r.request_id: r for r in requests}
    greedy = [r for r in requests if r.sampling.greedy]
    world.check_parity("hidden_states", greedy, [c for c in first if by_request[c.request_id].sampling.greedy])
    worst = max(
        _check(world, c, by_request[c.request_id], f"batch {c.request_id}#{c.index}")
        for c in first
        if by_request[c.request_id].sampling.return_hidden_states
    )
    world.report.timings["hidden_states_max_rel_error"] = worst
    # the switch is per request: the one that did not ask gets none
    (unasked,) = [c for c in first if c.request_id == requests[-1].request_id]
    assert unasked.hidden_states is None and unasked.prompt_hidden_states is None

    # a prefix-cache hit (the same prompts again, one now also asking for its prompt's states)
    again_requests = [
        GenerateRequest(prompt_token_ids=prompts[0], sampling=states, request_id=world.request_id("hs")),
        GenerateRequest(prompt_token_ids=prompts[0], sampling=with_prompt, request_id=world.request_id("hs")),
    ]
    again = world.generate(again_requests)
    for request, completion in zip(again_requests, again, strict=True):
        _check(world, completion, request, f"cache hit {request.request_id}")
    assert again[0].token_ids == first[0].token_ids

    # hidden states follow the weights served
    transports = world.local_transports()
    if transports:
        world.update(transports[0], OTHER)
        try:
            after = world.generate([GenerateRequest(prompt_token_ids=prompts[3], sampling=with_prompt)])[0]
            _check(world, after, GenerateRequest(prompt_token_ids=prompts[3], sampling=with_prompt), "after update")
        finally:
            world.update(transports[0], BASE)

    # streamed deltas carry no hidden states: asking for them there is refused
    if world.supports(Capability.STREAM):
        with pytest.raises(InvalidRequest):
            list(engine.stream(GenerateRequest(prompt_token_ids=prompts[0], sampling=states)))
