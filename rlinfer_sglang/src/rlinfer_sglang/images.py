"""Images for SGLang (capability ``generate.multimodal``), in process and in server mode.

SGLang takes a token prompt with images as ``input_ids`` holding the model's image token *once*
per image plus ``image_data`` (one entry per image; rlinfer sends ``data:`` URLs, which the
tokenizer manager and the HTTP server decode alike), and its multimodal processor expands each
placeholder to the image's run (Qwen2-VL: one ``<|image_pad|>`` per merged patch). Measured with
SGLang 0.5.23 on CPU: an already-expanded run is *not* recognised (the request hangs in the
tokenizer manager), and SGLang reports the expanded ids nowhere (its ``input_token_logprobs``
hold pad values at image positions; only ``meta_info.prompt_tokens`` counts them).

So the backend keeps the prompt *as the engine sees it* (placeholders expanded once, from the
HF processor's ``image_grid_thw``: :func:`rlinfer_core.multimodal.expand_image_runs`) everywhere
(max_tokens room, Completion.prompt_token_ids, prompt logprobs and hidden-state alignment), and
:func:`engine_input` collapses it back to one token per image only where the request is handed to
SGLang. :func:`check_expanded` compares SGLang's ``prompt_tokens`` with that length, so a
processor that expanded differently fails loudly instead of misaligning the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest, RLInferError, UnsupportedCapability
from rlinfer_core.multimodal import (
    MultiModalInfo,
    collapse_image_runs,
    expand_image_runs,
    grid_thw,
    image_runs,
    image_token_id,
    load_processor,
    placeholder_lengths,
)
from rlinfer_core.types import Capability, Completion, GenerateRequest, LogprobsMode
from rlinfer_sglang.capabilities import BACKEND


def image_token(model_dir: str) -> int:
    """The served model's image token id; InvalidRequest when it names none."""
    token = image_token_id(model_dir)
    if token is None:
        raise InvalidRequest("images", f"the model in {model_dir} names no image token (image_token_id) in config.json")
    return token


def expanded_prompt(model_dir: str, request: GenerateRequest, ids: list[int]) -> list[int]:
    """``ids`` as SGLang will see them: each image placeholder (one token or a run) expanded once
    to its image's length; ``ids`` unchanged for a request without images."""
    images = request.all_images
    if not images:
        return ids
    if request.sampling.logprobs_mode is LogprobsMode.RAW:
        raise UnsupportedCapability(
            Capability.LOGPROBS_RAW.value,
            BACKEND,
            "raw logprobs are scored by a second, text-only prefill (SGLang reports processed ones): not with images",
        )
    return expand_image_runs(ids, image_token(model_dir), placeholder_lengths(model_dir, images))


def engine_input(model_dir: str, request: GenerateRequest, ids: Sequence[int]) -> dict[str, Any]:
    """``GenerateReqInput`` / ``/generate`` fields for one sample's prompt ``ids`` (expanded by
    :func:`expanded_prompt`): ``input_ids``, and ``image_data`` where the request has images."""
    images = request.all_images
    if not images:
        return {"input_ids": list(ids)}
    return {
        "input_ids": collapse_image_runs(ids, image_token(model_dir)),
        "image_data": [image.data_url() for image in images],
    }


def multimodal_info(model_dir: str, request: GenerateRequest, ids: Sequence[int]) -> MultiModalInfo | None:
    """Completion.multimodal for the expanded prompt ``ids`` (None without images)."""
    images = request.all_images
    if not images:
        return None
    token = image_token(model_dir)
    return MultiModalInfo(
        image_token_id=token,
        placeholders=image_runs(ids, token),
        image_grid_thw=grid_thw(load_processor(model_dir), images),
    )


def check_expanded(request: GenerateRequest, ids: Sequence[int], meta: Mapping[str, Any]) -> None:
    """RLInferError when SGLang's prompt length differs from the expanded ``ids`` (its processor
    expanded the placeholders otherwise than the HF processor)."""
    seen = meta.get("prompt_tokens")
    if request.all_images and isinstance(seen, int) and seen != len(ids):
        raise RLInferError(
            f"SGLang expanded the image placeholders to a {seen}-token prompt, the HF processor to {len(ids)}: "
            "the completion's prompt ids would not be the ones the engine saw"
        )


def with_multimodal(
    model_dir: str, request: GenerateRequest, completion: Completion, meta: Mapping[str, Any]
) -> Completion:
    """``completion`` with Completion.multimodal set (unchanged without images), after
    :func:`check_expanded` against SGLang's ``meta_info``."""
    if not request.all_images:
        return completion
    check_expanded(request, completion.prompt_token_ids, meta)
    return attrs.evolve(completion, multimodal=multimodal_info(model_dir, request, completion.prompt_token_ids))
