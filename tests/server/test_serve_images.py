"""``rlinfer serve`` with a vision-language model: OpenAI ``image_url`` parts (data: URLs) in
``/v1/chat/completions``, through the ``openai`` client, against the HF processor and model.

A second server on the tiny Qwen2-VL of :mod:`rlinfer_core.tiny_vlm` (~40 s); the shared text
server refuses image parts (its engine does not claim generate.multimodal for a text model).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BACKEND, MODEL_NAME, Served, run_serve, write_config

QUESTION = "what is 2 + 3?"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlinfer_core.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "seed0", seed=0)


@pytest.fixture(scope="module")
def vlm_server(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if BACKEND != "vllm":
        pytest.skip("the image server test runs on vLLM (generate.multimodal of the in-process backend)")
    tmp = tmp_path_factory.mktemp("vlm-server")
    with run_serve(write_config(tmp / "rollout.yaml", vlm_dir), tmp, (vlm_dir, vlm_dir)) as served:
        yield served


def _chat(image_url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]


def _hf_greedy(model_dir: Path, image: Any, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy output ids) of the HF processor and model for the chat with ``image``."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0].tolist()[len(prompt) :]


def test_chat_with_an_image_url_part(vlm_server: Served, vlm_dir: Path) -> None:
    import openai

    from rlinfer_core.multimodal import to_image
    from rlinfer_core.tiny_vlm import tiny_image

    client = openai.OpenAI(base_url=f"{vlm_server.url}/v1", api_key="unused", timeout=120.0, max_retries=0)
    image = tiny_image(0)
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=_chat(to_image(image).data_url()), max_tokens=6, temperature=0
    )
    extra = out.choices[0].model_extra
    prompt, greedy = _hf_greedy(vlm_dir, image, 6)
    assert extra["prompt_token_ids"] == prompt, "prompt ids differ from the HF processor's (expanded once)"
    assert extra["token_ids"] == greedy
    other = client.chat.completions.create(
        model=MODEL_NAME, messages=_chat(to_image(tiny_image(1)).data_url()), max_tokens=6, temperature=0
    )
    assert other.choices[0].model_extra["token_ids"] != greedy, "another image gave the same answer"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=_chat("http://example.com/cat.png"), max_tokens=2)
    assert "data: URL" in str(info.value)


def test_text_server_refuses_image_parts(client: Any) -> None:
    import openai

    from rlinfer_core.multimodal import to_image
    from rlinfer_core.tiny_vlm import tiny_image

    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=_chat(to_image(tiny_image(0)).data_url()), max_tokens=2
        )
    assert "generate.multimodal" in str(info.value)
