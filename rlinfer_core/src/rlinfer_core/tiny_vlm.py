"""A tiny vision-language model in Qwen2-VL's layout, made on the fly (no hub access needed).

``make_tiny_vlm(dir, seed=0, spec)`` writes a complete Hugging Face model directory that
``AutoProcessor.from_pretrained(dir)`` and ``Qwen2VLForConditionalGeneration`` load offline,
and that vLLM and SGLang serve with their own Qwen2-VL model classes: a vision tower (patch
embedding, ``spec.vision_depth`` blocks), the patch merger, and a Qwen2 language model with
multimodal rotary positions; random fp32 weights, deterministic from ``seed``.

The tokenizer is the tiny byte-level BPE of :mod:`rlinfer_core.tiny_model` with Qwen2-VL's
special tokens (``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|image_pad|>``,
``<|vision_end|>``, ``<|video_pad|>``); the chat template renders each image part of a message
as ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor then expands the one
``<|image_pad|>`` to one per merged patch). The image processor is sized so that an image
becomes a few patches: ``min_pixels`` = ``max_pixels`` = ``spec.image_pixels`` (default 56x56:
a 4x4 patch grid, 4 image tokens after the 2x2 merge).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from rlinfer_core.tiny_model import CORPUS, _randomise_biases_and_norms, _train_tokenizer

#: Qwen2-VL's special tokens, in the order they get their ids (0..6)
VLM_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"

#: Qwen2-VL's chat template, trimmed: string content, or a list of text and image parts
#: (``{"type": "image"}``, ``{"type": "image_url", ...}``, or any part with an ``image`` key)
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') or 'image' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@attrs.frozen
class TinyVLMSpec:
    """Shape of the tiny VLM. Defaults: ~0.6M parameters, float32; language head_dim 64 and vision
    head_dim 64 (CPU attention kernels reject smaller)."""

    vocab_size: int = 384
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 2048
    vision_depth: int = 2
    vision_embed_dim: int = 128
    vision_num_heads: int = 2
    vision_mlp_ratio: int = 2
    #: pixels an image is resized to (both min_pixels and max_pixels of the image processor)
    image_pixels: int = 56 * 56
    #: larger than the text models' 0.02: at 0.02 greedy outputs ignore the image
    init_std: float = 0.05
    dtype: str = "float32"


def _tokenizer() -> object:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(384, VLM_SPECIAL_TOKENS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=VLM_SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def _config(spec: TinyVLMSpec, tokenizer: object) -> object:
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VLM_SPECIAL_TOKENS}  # type: ignore[attr-defined]
    head_dim = spec.hidden_size // spec.num_attention_heads
    unit = head_dim // 16  # mrope splits head_dim / 2 rotary pairs 2:3:3 (temporal, height, width)
    text = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        max_window_layers=spec.num_hidden_layers,
        initializer_range=spec.init_std,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [2 * unit, 3 * unit, 3 * unit],
        },
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    vision = dict(
        depth=spec.vision_depth,
        embed_dim=spec.vision_embed_dim,
        hidden_size=spec.hidden_size,
        mlp_ratio=spec.vision_mlp_ratio,
        num_heads=spec.vision_num_heads,
        initializer_range=spec.init_std,
        # the released Qwen2-VL checkpoints' name for in_channels, which SGLang's Qwen2-VL reads
        in_chans=3,
    )
    return transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids[VIDEO_TOKEN],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )


def _save_processor(spec: TinyVLMSpec, tokenizer: object, out: Path) -> None:
    """The processor's files: tokenizer, the PIL image processor, the video processor's config and
    the chat template. Written piece by piece: building transformers' Qwen2VLProcessor object
    needs torchvision (for its video processor), loading the directory needs it too, writing it
    does not."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = dict(min_pixels=spec.image_pixels, max_pixels=spec.image_pixels)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    Qwen2VLImageProcessorPil(**pixels).save_pretrained(out)
    video = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": spec.image_pixels, "longest_edge": spec.image_pixels},
        **pixels,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=1))
    (out / "chat_template.jinja").write_text(VLM_CHAT_TEMPLATE)


def make_tiny_vlm(path: str | Path, seed: int = 0, spec: TinyVLMSpec | None = None) -> Path:
    """Write a tiny random Qwen2-VL model directory at ``path`` and return it.

    The same ``seed`` and ``spec`` always give the same weights and tokenizer; another seed gives
    other weights (vision tower and language model) with the same tokenizer and shapes (a "second
    model" for weight updates).
    """
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    spec = spec or TinyVLMSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    _save_processor(spec, tokenizer, out)
    config = _config(spec, tokenizer)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(getattr(torch, spec.dtype))
        _randomise_biases_and_norms(model, spec.init_std)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out, safe_serialization=True)
    (out / "rlinfer_tiny_model.json").write_text(
        json.dumps({"seed": seed, "architecture": "qwen2_vl", **attrs.asdict(spec)}, indent=1)
    )
    return out


def tiny_image(seed: int = 0, size: int = 56) -> object:
    """A deterministic RGB PIL image of ``size`` x ``size`` pixels (random colours from ``seed``)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


__all__ = ["CORPUS", "IMAGE_TOKEN", "TinyVLMSpec", "make_tiny_vlm", "tiny_image"]
