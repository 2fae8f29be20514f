"""Routing replay (capability ``generate.routed_experts``): the experts the engine routed every
token to, in rlinfer's one alignment (:mod:`rlinfer_core.routing`), against the HF oracle's router.

Each MoE architecture of :data:`rlinfer_core.tiny_model.MOE_ARCHITECTURES` gets an engine started
with ``EngineConfig(enable_routed_experts=True)``. For every position of prompt + completion but
the last, the engine's ``top_k`` experts of every layer must be the oracle router's top ``top_k``
(as sets), unless the oracle's k-th and (k+1)-th router scores are within :data:`TIE_MARGIN`; the
last row is the sentinel. A prefix-cache hit must give the same routes; a request that does not
ask gets none.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.report import KitReport
from rlinfer_conformance.world import default_config, make_models, open_or_skip
from rlinfer_core.routing import MISSING
from rlinfer_core.tiny_model import MOE_ARCHITECTURES
from rlinfer_core.types import Capability, Completion, GenerateRequest, SamplingParams

__all__ = ["rlinfer_routing_engine", "test_routed_experts_match_the_oracle_router"]

#: checked on this module's own engines (opened with enable_routed_experts=True), not the session's
OWN_ENGINE_CAPABILITIES = (Capability.GENERATE_ROUTED_EXPERTS,)

#: router scores closer than this at the top-k boundary count as a tie (either choice is right)
TIE_MARGIN = 1e-4

PROMPTS = (
    [5, 17, 42, 99, 23, 7, 64, 128, 250, 31, 12, 77, 300, 45, 9, 18, 36, 72, 144, 200],
    [11, 22, 33, 44, 55],
    [301, 3, 150, 90, 60, 30, 15, 8, 4, 2, 1, 100, 110, 120],
)


class RoutingEngine:
    """An engine started with routed-experts capture, and the HF model it serves."""

    def __init__(self, engine: Any, hf_model: Any, architecture: str) -> None:
        self.engine = engine
        self.hf_model = hf_model
        self.architecture = architecture

    def oracle_scores(self, token_ids: Sequence[int]) -> list[Any]:
        """The HF router's scores per layer ([len, experts] each) over ``token_ids``."""
        import torch

        with torch.inference_mode():
            out = self.hf_model(torch.tensor([list(token_ids)], dtype=torch.long), output_router_logits=True)
        return [r.float().reshape(len(token_ids), -1) for r in out.router_logits]


@pytest.fixture(scope="module", params=sorted(MOE_ARCHITECTURES))
def rlinfer_routing_engine(
    request: pytest.FixtureRequest,
    rlinfer_backend: str,
    rlinfer_config_overrides: dict[str, Any],
    rlinfer_report: KitReport,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RoutingEngine]:
    """An engine on the tiny MoE model of one architecture, able to return routed experts."""
    import torch
    from transformers import AutoModelForCausalLM

    architecture = str(request.param)
    tmp = Path(tmp_path_factory.mktemp(f"rlinfer-kit-routes-{architecture}"))
    base_dir, _ = make_models(tmp, architecture)
    config = default_config(base_dir, {**rlinfer_config_overrides, "enable_routed_experts": True})
    why = f"{Capability.GENERATE_ROUTED_EXPERTS.value} not supported"
    engine = open_or_skip(rlinfer_backend, config, rlinfer_report, f"routes_{architecture}", why)
    hf_model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    try:
        yield RoutingEngine(engine, hf_model, architecture)
    finally:
        engine.shutdown()


def _check_routes(world: RoutingEngine, completion: Completion, where: str) -> int:
    """Assert ``completion``'s routes against the oracle's router; return the rows compared."""
    routes = completion.routed_experts
    assert routes is not None, f"{where}: no routed_experts although the request asked for them"
    sequence = [*completion.prompt_token_ids, *completion.token_ids]
    config = world.hf_model.config
    top_k = int(config.num_experts_per_tok)
    assert routes.shape == (len(sequence), int(config.num_hidden_layers), top_k), (
        f"{where}: routes of shape {routes.shape}, expected [{len(sequence)}, layers, {top_k}]"
    )
    array = routes.array()
    assert (array[-1] == MISSING).all(), f"{where}: the last token is never routed, its row must be {MISSING}"
    scores = world.oracle_scores(sequence[:-1])
    compared = ties = 0
    for layer, layer_scores in enumerate(scores):
        ordered, experts = layer_scores.sort(dim=-1, descending=True)
        for position in range(len(sequence) - 1):
            got = array[position, layer]
            assert (got >= 0).all(), f"{where}: position {position} layer {layer} has no route: {got.tolist()}"
            gap = float(ordered[position, top_k - 1] - ordered[position, top_k]) if ordered.shape[1] > top_k else 1.0
            if gap < TIE_MARGIN:
                ties += 1
                continue
            want = {int(e) for e in experts[position, :top_k]}
            assert set(got.tolist()) == want, (
                f"{where}: position {position} (token {sequence[position]}) layer {layer}: engine routed to "
                f"{sorted(got.tolist())}, the oracle's router to {sorted(want)}"
            )
            compared += 1
    assert compared > ties, f"{where}: only {compared} rows compared, {ties} ties"
    return compared


@pytest.mark.hooks("rlinfer_generate")
def test_routed_experts_match_the_oracle_router(rlinfer_routing_engine: RoutingEngine) -> None:
    world = rlinfer_routing_engine
    engine = world.engine
    assert engine.capabilities.supports(Capability.GENERATE_ROUTED_EXPERTS), (
        "an engine opened with enable_routed_experts=True on an MoE model must claim generate.routed_experts"
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, return_routed_experts=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, n=2, return_routed_experts=True)
    requests = [GenerateRequest(prompt_token_ids=p, sampling=greedy) for p in PROMPTS]
    requests.append(GenerateRequest(prompt_token_ids=PROMPTS[1], sampling=sampled))
    first = engine.generate(requests)
    rows = sum(_check_routes(world, c, f"{world.architecture} batch #{i}") for i, c in enumerate(first))
    assert rows > 0

    # a prefix-cache hit (the same prompt again) reports the same routes, not the sentinel
    again = engine.generate([GenerateRequest(prompt_token_ids=PROMPTS[0], sampling=greedy)])[0]
    _check_routes(world, again, f"{world.architecture} cache hit")
    assert again.token_ids == first[0].token_ids
    assert again.routed_experts == first[0].routed_experts, "a prefix-cache hit changed the reported routes"

    # a longer prompt sharing that prefix: the cached positions carry their routes too
    longer = [*PROMPTS[0], *first[0].token_ids[:4], 61, 62]
    extended = engine.generate([GenerateRequest(prompt_token_ids=longer, sampling=greedy)])[0]
    _check_routes(world, extended, f"{world.architecture} extended prefix")

    # the switch is per request: a request that does not ask gets no routes
    plain = engine.generate([GenerateRequest(prompt_token_ids=PROMPTS[2], sampling=SamplingParams(max_tokens=4))])
    assert plain[0].routed_experts is None
