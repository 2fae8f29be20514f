"""Hidden states over ``rlinfer serve --dialect sglang`` (docs/engines.md, "Hidden states out"):
SGLang's ``/generate`` with ``return_hidden_states`` answers ``meta_info.hidden_states`` in
SGLang's layout of an uncached request (the prompt's rows in one list, then one row per decode
step), equal to the HF oracle's final-layer states; an engine started without the switch answers
400 ``unsupported_capability``. One real SGLang CPU engine on the tiny Llama per server.

Run from ``.venvs/sglang`` (``make test-server-sglang``): two servers, one at a time (~20 s each).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from dialect_servers import DialectServer, rlinfer_serve_command, started

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="needs the SGLang backend (.venvs/sglang)"
)

PROMPT = [1, 5, 6, 7, 9, 11]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlinfer_core.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama") / "llama", 0)


def _serve(model: Path, tmp: Path, states: bool) -> Iterator[DialectServer]:
    ready = tmp / "ready.json"
    command = [*rlinfer_serve_command("rlinfer-sglang", model, "sglang", ready), "--served-model-name", "m"]
    if states:
        command += ["--set", "enable_hidden_states=true"]
    with started("rlinfer-sglang-sglang", command, os.environ.copy(), tmp, ready, None) as served:
        yield served


def _generate(server: DialectServer, **extra: object) -> httpx.Response:
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with server.client() as client:
        return client.post("/generate", json={"input_ids": PROMPT, "sampling_params": params, **extra})


def test_sglang_generate_answers_hidden_states_in_sglang_layout(model: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    for server in _serve(model, tmp_path, states=True):
        r = _generate(server, return_hidden_states=True)
        plain = _generate(server)
        streamed = _generate(server, return_hidden_states=True, stream=True)
    assert r.status_code == 200, r.text
    answer = r.json()
    output = answer["output_ids"]
    prefill, *decode = answer["meta_info"]["hidden_states"]
    assert len(prefill) == len(PROMPT) and len(decode) == len(output) - 1
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.base_model(torch.tensor([[*PROMPT, *output[:-1]]])).last_hidden_state[0].numpy()
    got = np.asarray([*prefill, *decode], dtype=np.float32)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert "hidden_states" not in plain.json()["meta_info"]  # only when asked
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "return_hidden_states"


def test_an_engine_without_the_switch_refuses(model: Path, tmp_path: Path) -> None:
    for server in _serve(model, tmp_path, states=False):
        r = _generate(server, return_hidden_states=True)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "generate.hidden_states"
