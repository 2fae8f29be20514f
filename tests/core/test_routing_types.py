"""Routing replay's contract types (rlinfer_core.routing): alignment, sentinel, wire form, checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.preflight import request_capabilities
from rlinfer_core.routing import MISSING, RoutedExperts, aligned, moe_shape
from rlinfer_core.types import Capability, Completion, FinishReason, GenerateRequest, SamplingParams
from rlinfer_core.wire import from_wire, to_wire


def test_aligned_places_engine_rows_and_marks_the_rest_missing() -> None:
    # 3 prompt + 2 output tokens: engines report positions [0, 4), 2 layers, top-2
    rows = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8
    routes = aligned(rows.reshape(-1), 0, 5, 2, 2)
    assert routes.shape == (5, 2, 2)
    assert routes.array()[:4].tolist() == rows.tolist()
    assert routes.missing() == [4]
    assert (routes.array()[4] == MISSING).all()


def test_aligned_drops_rows_past_the_tokens_kept_and_honours_a_start() -> None:
    rows = np.ones((6, 1, 2), dtype=np.int32)
    assert aligned(rows, 0, 3, 1, 2).missing() == []  # rlinfer cut the output after a stop
    assert aligned(rows[:2], 2, 5, 1, 2).missing() == [0, 1, 4]
    with pytest.raises(ValueError):
        aligned(np.ones(5, dtype=np.int32), 0, 3, 1, 2)


def test_routes_cross_the_wire_and_json_by_value() -> None:
    routes = RoutedExperts.from_array([[[1, 7]], [[MISSING, MISSING]]])
    completion = Completion("r", 0, (1,), (2,), (-0.1,), FinishReason.LENGTH, routed_experts=routes)
    wire = json.loads(json.dumps(to_wire(completion)))
    back = from_wire(wire, Completion)
    assert back == completion
    assert back.routed_experts is not None and back.routed_experts.tolist() == [[[1, 7]], [[-1, -1]]]


def test_bad_route_data_is_refused_typed() -> None:
    with pytest.raises(InvalidRequest):
        RoutedExperts(num_layers=2, top_k=2, data=b"\x00" * 6)
    with pytest.raises(InvalidRequest):
        RoutedExperts.from_array(np.zeros((2, 2)))
    with pytest.raises(InvalidRequest):
        SamplingParams(return_routed_experts="yes")  # type: ignore[arg-type]


def test_the_switch_needs_the_capability() -> None:
    request = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(return_routed_experts=True))
    assert Capability.GENERATE_ROUTED_EXPERTS in request_capabilities(request)
    assert Capability.GENERATE_ROUTED_EXPERTS not in request_capabilities(GenerateRequest(prompt_token_ids=[1]))


def test_moe_shape_reads_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2})
    )
    assert moe_shape(str(tmp_path)) == (3, 2)
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    assert moe_shape(str(dense)) is None
    assert moe_shape(str(tmp_path / "missing")) is None
