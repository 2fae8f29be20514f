"""Hidden states' contract types (rlinfer_core.hidden_states): alignment, NaN for missing rows,
wire form, the request switch and its checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.hidden_states import HiddenStates, hidden_size, split_positions
from rlinfer_core.preflight import request_capabilities
from rlinfer_core.types import Capability, Completion, EngineConfig, FinishReason, GenerateRequest, SamplingParams
from rlinfer_core.wire import from_wire, to_wire


def _rows(positions: range, hidden: int = 2) -> np.ndarray:
    """Row p holds (p, p + 0.5, ...): each row names its position."""
    return np.array([[p + 0.5 * j for j in range(hidden)] for p in positions], dtype=np.float32)


def test_split_positions_aligns_output_rows_on_the_state_that_produced_each_token() -> None:
    # 3 prompt + 4 output tokens: an engine computes positions [0, 6) (the last token is never fed)
    prompt, output = split_positions(_rows(range(6)), 0, 3, 4, 2, with_prompt=True)
    assert output.shape == (4, 2) and prompt is not None and prompt.shape == (3, 2)
    assert output.array()[:, 0].tolist() == [2, 3, 4, 5]  # token i came from position 3 + i - 1
    assert prompt.array()[:, 0].tolist() == [0, 1, 2]
    assert (prompt.array()[-1] == output.array()[0]).all()
    assert split_positions(_rows(range(6)), 0, 3, 4, 2, with_prompt=False)[0] is None


def test_split_positions_marks_uncomputed_rows_nan_and_drops_rows_past_the_kept_tokens() -> None:
    # a cached prefix of 2: the engine computed positions [2, 6)
    prompt, output = split_positions(_rows(range(2, 6)), 2, 3, 4, 2, with_prompt=True)
    assert prompt is not None and prompt.missing() == [0, 1]
    assert output.missing() == []
    # rlinfer cut the output to 2 tokens after a stop: the engine's later rows are dropped
    _, cut = split_positions(_rows(range(6)), 0, 3, 2, 2, with_prompt=False)
    assert cut.array()[:, 0].tolist() == [2, 3]
    # aborted before any output: no rows
    _, empty = split_positions(np.empty((0, 2)), 0, 3, 0, 2, with_prompt=False)
    assert empty.shape == (0, 2)


def test_hidden_states_cross_the_wire_and_json_by_value() -> None:
    states = HiddenStates.from_array([[1.5, -2.0], [math.nan, math.nan]])
    completion = Completion(
        "r", 0, (1,), (2, 3), (-0.1, -0.2), FinishReason.LENGTH, hidden_states=states, prompt_hidden_states=None
    )
    back = from_wire(json.loads(json.dumps(to_wire(completion))), Completion)
    assert back.hidden_states is not None and back.hidden_states.data == states.data
    assert back.hidden_states.missing() == [1]
    assert back.hidden_states.tolist()[0] == [1.5, -2.0]


def test_bad_hidden_state_data_and_switches_are_refused_typed() -> None:
    with pytest.raises(InvalidRequest):
        HiddenStates(hidden_size=2, data=b"\x00" * 6)
    with pytest.raises(InvalidRequest):
        HiddenStates.from_array(np.zeros(3))
    with pytest.raises(InvalidRequest):
        SamplingParams(return_hidden_states="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="needs return_hidden_states"):
        SamplingParams(prompt_hidden_states=True)
    with pytest.raises(InvalidRequest):
        EngineConfig(model="m", enable_hidden_states=1)  # type: ignore[arg-type]


def test_the_switch_needs_the_capability() -> None:
    request = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(return_hidden_states=True))
    assert Capability.GENERATE_HIDDEN_STATES in request_capabilities(request)
    assert Capability.GENERATE_HIDDEN_STATES not in request_capabilities(GenerateRequest(prompt_token_ids=[1]))


def test_hidden_size_reads_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert hidden_size(str(tmp_path)) == 64
    assert hidden_size(str(tmp_path / "absent")) is None


def test_rlinfer_serve_sglang_generate_passes_hidden_states_through() -> None:
    """``--dialect sglang``'s /generate (no engine): ``return_hidden_states`` asks for output and
    prompt rows; the answer lays them out as SGLang does for an uncached prefill."""
    from rlinfer_server.sglang_generate import answer_of, generate_plan
    from rlinfer_server.sglang_schemas import SglGenerateBody

    body = SglGenerateBody.model_validate(
        {"input_ids": [1, 2, 3], "return_hidden_states": True, "sampling_params": {"max_new_tokens": 3}}
    )
    plan = generate_plan(body, tokens=None)  # type: ignore[arg-type]  # ids: no tokenizer
    (request,) = plan.requests
    assert request.sampling.return_hidden_states and request.sampling.prompt_hidden_states
    rows = np.arange(5 * 2, dtype=np.float32).reshape(5, 2)  # positions 0..4 of 3 prompt + 3 output tokens
    prompt, output = split_positions(rows, 0, 3, 3, 2, with_prompt=True)
    completion = Completion(
        request.request_id,
        0,
        (1, 2, 3),
        (4, 5, 6),
        (-0.1,) * 3,
        FinishReason.LENGTH,
        hidden_states=output,
        prompt_hidden_states=prompt,
    )

    class _NoTextTokens:  # a stand-in tokenizer: no text is decoded here
        def decode(self, ids: object, skip: bool) -> str:
            return ""

    answer = answer_of(completion, plan.plans[0], _NoTextTokens(), "id")  # type: ignore[arg-type]
    assert answer["meta_info"]["hidden_states"] == [rows[:3].tolist(), rows[3].tolist(), rows[4].tolist()]
    streamed = SglGenerateBody.model_validate(
        {"input_ids": [1, 2], "stream": True, "return_hidden_states": True, "sampling_params": {"max_new_tokens": 2}}
    )
    with pytest.raises(InvalidRequest, match="return_hidden_states"):
        generate_plan(streamed, tokens=None)  # type: ignore[arg-type]
