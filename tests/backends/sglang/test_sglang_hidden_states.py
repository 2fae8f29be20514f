"""SGLang's hidden-state output mapped onto rlinfer (no engine): the start switch, the request
arguments, and meta_info.hidden_states (prefill chunks, then one row per decode step) in
rlinfer's alignment (rlinfer_core.hidden_states)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rlinfer_core.types import EngineConfig, GenerateRequest, SamplingParams
from rlinfer_sglang import outputs, requests
from rlinfer_sglang.config import server_args


def _request(**sampling: object) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


def _row(position: int) -> list[float]:
    return [float(position), position + 0.5]


def test_the_engine_switch_maps_to_enable_return_hidden_states(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 2}')
    assert server_args(EngineConfig(model=str(tmp_path), enable_hidden_states=True), "cpu")[
        "enable_return_hidden_states"
    ]
    assert "enable_return_hidden_states" not in server_args(EngineConfig(model=str(tmp_path)), "cpu")


def test_prompt_hidden_states_prefill_the_whole_prompt() -> None:
    # SGLang matches no cached prefix past logprob_start_len: 0 computes every prompt position
    assert (
        requests.logprob_args(_request(return_hidden_states=True, prompt_hidden_states=True))["logprob_start_len"] == 0
    )
    assert requests.logprob_args(_request(return_hidden_states=True))["logprob_start_len"] == -1


def test_meta_hidden_states_in_rlinfer_alignment() -> None:
    # prompt of 3, 4 tokens out: one prefill chunk of positions [0, 3), then decode rows 3, 4, 5
    meta = {"hidden_states": [[_row(0), _row(1), _row(2)], _row(3), _row(4), _row(5)]}
    prompt, output = outputs.hidden_states(
        _request(return_hidden_states=True, prompt_hidden_states=True), meta, 3, 4, 2
    )
    assert output is not None and output.array()[:, 0].tolist() == [2, 3, 4, 5]
    assert prompt is not None and prompt.array()[:, 0].tolist() == [0, 1, 2]
    # a cached prefix of 2: the prefill chunk holds the last prompt position only
    cached = {"hidden_states": [[_row(2)], _row(3), _row(4), _row(5)]}
    _, output = outputs.hidden_states(_request(return_hidden_states=True), cached, 3, 4, 2)
    assert output is not None and output.array()[:, 0].tolist() == [2, 3, 4, 5]
    # two prefill chunks: they end at the prompt's last position
    chunked = {"hidden_states": [[_row(0)], [_row(1), _row(2)], _row(3)]}
    prompt, output = outputs.hidden_states(
        _request(return_hidden_states=True, prompt_hidden_states=True), chunked, 3, 2, 2
    )
    assert prompt is not None and prompt.array()[:, 0].tolist() == [0, 1, 2]
    assert output is not None and output.array()[:, 0].tolist() == [2, 3]
    # not asked: none, whatever SGLang sent
    assert outputs.hidden_states(_request(), meta, 3, 4, 2) == (None, None)
    # nothing reported (aborted before output): empty output, NaN prompt rows
    prompt, output = outputs.hidden_states(_request(return_hidden_states=True, prompt_hidden_states=True), {}, 3, 0, 2)
    assert output is not None and output.shape == (0, 2)
    assert prompt is not None and prompt.missing() == [0, 1, 2] and np.isnan(prompt.array()).all()


def test_server_mode_claims_hidden_states_only_from_a_server_started_with_them() -> None:
    from rlinfer_core.types import Capability
    from rlinfer_sglang.capabilities import capabilities
    from rlinfer_sglang.requests import sample_body
    from rlinfer_sglang.transport.http_capabilities import server_capabilities

    base = capabilities("cpu", "sglang 0.5.23")
    url = "http://127.0.0.1:30000"
    off = server_capabilities(base, {}, url, True, False)
    assert not off.supports(Capability.GENERATE_HIDDEN_STATES)
    assert "--enable-return-hidden-states" in off.notes[Capability.GENERATE_HIDDEN_STATES.value]
    on = server_capabilities(base, {"enable_return_hidden_states": True}, url, True, False)
    assert on.supports(Capability.GENERATE_HIDDEN_STATES)
    request = _request(return_hidden_states=True)
    assert sample_body(request, [1, 2, 3], {}, "rid", "", False)["return_hidden_states"] is True
    assert sample_body(_request(), [1, 2, 3], {}, "rid", "", False)["return_hidden_states"] is False
