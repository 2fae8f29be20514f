"""``rlinfer serve --dialect sglang``'s ``/generate`` takes SGLang's ``image_data`` (no engine):
each prompt's data: URLs become its GenerateRequest.images, in SGLang's single and batched forms."""

from __future__ import annotations

import pytest

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.multimodal import to_image


def _url(seed: int) -> str:
    import numpy as np

    pixels = np.full((8, 8, 3), seed, dtype=np.uint8)
    return to_image(pixels).data_url()


def _plan(body: dict[str, object]) -> object:
    from rlinfer_server.sglang_generate import generate_plan
    from rlinfer_server.sglang_schemas import SglGenerateBody

    return generate_plan(SglGenerateBody.model_validate(body), tokens=None)  # type: ignore[arg-type]  # ids only


def test_one_prompt_takes_one_url_or_a_list() -> None:
    (single,) = _plan({"input_ids": [1, 5, 2], "image_data": _url(1)}).requests  # type: ignore[attr-defined]
    assert single.images == (to_image(_url(1)),)
    (several,) = _plan({"input_ids": [1, 5, 5, 2], "image_data": [_url(1), _url(2)]}).requests  # type: ignore[attr-defined]
    assert several.images == (to_image(_url(1)), to_image(_url(2)))
    (none,) = _plan({"input_ids": [1, 2]}).requests  # type: ignore[attr-defined]
    assert none.images == ()


def test_a_batch_takes_a_list_per_prompt() -> None:
    requests = _plan(
        {"input_ids": [[1, 5, 2], [1, 2], [5, 5]], "image_data": [[_url(1)], None, [_url(2), _url(3)]]}
    ).requests  # type: ignore[attr-defined]
    assert [len(r.images) for r in requests] == [1, 0, 2]
    with pytest.raises(InvalidRequest, match="image_data"):
        _plan({"input_ids": [[1, 5], [1, 5]], "image_data": [[_url(1)]]})


def test_only_data_urls_are_taken() -> None:
    with pytest.raises(InvalidRequest, match="data: URLs"):
        _plan({"input_ids": [1, 5, 2], "image_data": "http://example.com/cat.png"})
