"""Images in requests: conversion to encoded bytes, chat content parts, placeholder runs."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.multimodal import Image, ImagePart, TextPart, collapse_image_runs, image_runs, to_image
from rlinfer_core.preflight import request_capabilities
from rlinfer_core.types import Capability, ChatMessage, GenerateRequest


def _array() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(8, 6, 3), dtype=np.uint8)


def test_pil_array_bytes_and_data_url_give_the_same_pixels() -> None:
    pixels = _array()
    from_array = to_image(pixels)
    from_pil = to_image(PILImage.fromarray(pixels))
    from_bytes = to_image(from_array.data)
    from_url = to_image(from_array.data_url())
    assert from_array == from_pil == from_bytes == from_url
    assert np.array_equal(np.asarray(from_url.to_pil()), pixels)


def test_jpeg_bytes_are_kept_as_sent() -> None:
    buffer = io.BytesIO()
    PILImage.fromarray(_array()).save(buffer, format="JPEG")
    image = to_image(buffer.getvalue())
    assert image.data == buffer.getvalue() and image.data_url().startswith("data:image/jpeg;base64,")


@pytest.mark.parametrize(
    "bad",
    [b"not an image", "http://example.com/cat.png", "data:image/png,raw", 42, np.zeros((2, 2, 3), dtype=np.float64)],
)
def test_bad_images_raise_invalid_request(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        to_image(bad)


def test_chat_content_parts_in_openai_shapes() -> None:
    url = to_image(_array()).data_url()
    message = ChatMessage(
        role="user",
        content=[
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is this?"},
            {"type": "image", "image": _array()},
        ],
    )
    assert isinstance(message.content, tuple)
    assert [type(p) for p in message.content] == [ImagePart, TextPart, ImagePart]
    assert len(message.images) == 2 and message.images[0] == message.images[1]
    assert message.template_dict() == {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}, {"type": "image"}],
    }
    with pytest.raises(InvalidRequest):
        ChatMessage(role="user", content=[{"type": "audio", "audio": b""}])


def test_requests_with_images_need_generate_multimodal() -> None:
    image = to_image(_array())
    by_ids = GenerateRequest(prompt_token_ids=[1, 5, 2], images=[image])
    by_chat = GenerateRequest(messages=[{"role": "user", "content": [{"type": "image", "image": image}]}])
    text_only = GenerateRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert by_ids.all_images == by_chat.all_images == (image,)
    assert Capability.MULTIMODAL in request_capabilities(by_ids)
    assert Capability.MULTIMODAL in request_capabilities(by_chat)
    assert Capability.MULTIMODAL not in request_capabilities(text_only)
    with pytest.raises(InvalidRequest):
        GenerateRequest(messages=[{"role": "user", "content": "hi"}], images=[image])
    with pytest.raises(InvalidRequest):
        GenerateRequest(prompt_token_ids=[1], images=image)


def test_placeholder_runs_collapse_to_one_token_each() -> None:
    expanded = [1, 3, 9, 9, 9, 9, 4, 7, 3, 9, 9, 4]
    assert collapse_image_runs(expanded, 9) == [1, 3, 9, 4, 7, 3, 9, 4]
    assert image_runs(expanded, 9) == ((2, 4), (9, 2))
    assert collapse_image_runs([1, 2], 9) == [1, 2] and image_runs([9], 9) == ((0, 1),)


def test_image_repr_hides_the_bytes() -> None:
    assert "bytes>" in repr(Image(base64.b64decode(to_image(_array()).data_url().split(",")[1])))


def test_score_requests_carry_their_images_to_generate() -> None:
    from rlinfer_core.scoring import ScoreRequest, to_generate

    image = to_image(_array())
    request = to_generate(ScoreRequest([1, 9, 2], [3], images=[_array()]))
    assert request.images == (image,) and Capability.MULTIMODAL in request_capabilities(request)
    assert to_generate(ScoreRequest([1, 2], [3])).images == ()


def test_checkpoint_names_follow_the_stored_layout(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from rlinfer_core.multimodal import checkpoint_names

    save_file({"visual.a.weight": torch.zeros(1), "model.layers.0.w": torch.zeros(1)}, str(tmp_path / "m.safetensors"))
    runtime = ["model.visual.a.weight", "model.language_model.layers.0.w", "lm_head.weight"]
    assert checkpoint_names(tmp_path, runtime) == {
        "model.visual.a.weight": "visual.a.weight",
        "model.language_model.layers.0.w": "model.layers.0.w",
    }
