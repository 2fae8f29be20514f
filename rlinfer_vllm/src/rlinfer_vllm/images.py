"""Images for vLLM (capability ``generate.multimodal``).

vLLM takes a token prompt with images as ``{"prompt_token_ids": ids, "multi_modal_data":
{"image": [PIL images]}}`` and expands *every* image token in ``ids`` to the image's placeholder
run (for Qwen2-VL, one ``<|image_pad|>`` per merged patch). An already-expanded prompt (a previous
completion's ``prompt_token_ids``, a session's next turn) would be expanded a second time, so each
run of image tokens is shortened to one first (:func:`rlinfer_core.multimodal.collapse_image_runs`).
vLLM's ``RequestOutput.prompt_token_ids`` are the expanded ids; ``Completion.multimodal`` adds
where each image's run sits and the HF processor's ``image_grid_thw`` (vLLM runs that processor).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.multimodal import Image, MultiModalInfo, collapse_image_runs, grid_thw, image_runs, image_token_id


@functools.lru_cache(maxsize=4)
def _processor(model_dir: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


@functools.lru_cache(maxsize=4)
def _merge_size(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int((config.get("vision_config") or {}).get("spatial_merge_size", 1))


def image_token(model_dir: str) -> int:
    """The model's image token id; InvalidRequest when the model has none."""
    token = image_token_id(model_dir)
    if token is None:
        raise InvalidRequest("images", f"the model in {model_dir} names no image token (image_token_id) in config.json")
    return token


def engine_prompt(model_dir: str, ids: Sequence[int], images: Sequence[Image]) -> tuple[dict[str, Any], int]:
    """vLLM's prompt for ``ids`` with ``images``, and the expanded prompt length (for the
    max_tokens room). InvalidRequest when the placeholders and the images do not pair up."""
    token = image_token(model_dir)
    collapsed = collapse_image_runs(ids, token)
    placeholders = sum(1 for t in collapsed if t == token)
    if placeholders != len(images):
        raise InvalidRequest(
            "images",
            f"the prompt has {placeholders} image placeholder(s) (runs of token {token}) for {len(images)} image(s)",
        )
    grids = grid_thw(_processor(model_dir), images) or ()
    expanded = len(collapsed) - len(images) + sum(t * h * w for t, h, w in grids) // _merge_size(model_dir) ** 2
    prompt = {"prompt_token_ids": collapsed, "multi_modal_data": {"image": [image.to_pil() for image in images]}}
    return prompt, max(expanded, len(collapsed))


def multimodal_info(model_dir: str, prompt_ids: Sequence[int], images: Sequence[Image]) -> MultiModalInfo:
    """Completion.multimodal for the expanded ``prompt_ids`` vLLM reports."""
    token = image_token(model_dir)
    return MultiModalInfo(
        image_token_id=token,
        placeholders=image_runs(prompt_ids, token),
        image_grid_thw=grid_thw(_processor(model_dir), images),
    )
