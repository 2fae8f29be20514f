"""Images in requests (capability ``generate.multimodal``): the input types, chat content parts,
and what a completion reports about them.

An :class:`Image` holds *encoded* image bytes (PNG, JPEG, ...): PIL images, numpy arrays and
``data:`` URLs are converted once, here, so a request pickles and travels over HTTP unchanged
and every engine decodes the same pixels. Arrays and PIL images are stored as PNG (lossless).

Where images go:

- ``GenerateRequest(messages=...)``: image parts inside a message's content (OpenAI's shapes:
  ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` or
  ``{"type": "image", "image": <PIL image | bytes | array>}``); the chat template renders each
  as the model's image placeholder;
- ``GenerateRequest(prompt_token_ids=..., images=[...])``: the ids hold the model's image token
  once per image (``<|image_pad|>`` for Qwen2-VL), or the placeholder *already expanded* (a run
  of image tokens, as a previous completion's ``prompt_token_ids`` hold it): each run counts as
  one image, and the engine expands it exactly once (:func:`collapse_image_runs`).

The completion's ``prompt_token_ids`` are the ids the engine saw, placeholders expanded, and
``Completion.multimodal`` (:class:`MultiModalInfo`) holds the processor's per-image metadata (for
Qwen2-VL ``image_grid_thw``) and where each image's tokens sit, so that a trainer builds the same
model inputs: those ids, and the processor's pixel values of the same images.
"""

from __future__ import annotations

import base64
import functools
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest

#: at most this many images per request (a guard against runaway inputs, not an engine limit)
MAX_IMAGES = 64


def _encode_png(pil_image: Any) -> bytes:
    buffer = io.BytesIO()
    pil_image.save(buffer, format="PNG")
    return buffer.getvalue()


def _from_data_url(url: str, field: str) -> bytes:
    if not url.startswith("data:"):
        raise InvalidRequest(field, f"only data: URLs are accepted (no fetching), got {url[:40]!r}")
    header, _, payload = url.partition(",")
    if ";base64" not in header or not payload:
        raise InvalidRequest(field, "a data: URL must be base64-encoded (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as exc:
        raise InvalidRequest(field, f"the data: URL's base64 payload does not decode: {exc}") from exc


@attrs.frozen
class Image:
    """One image as encoded bytes (PNG, JPEG, WebP, ...); build it with :func:`to_image`."""

    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")

    def to_pil(self) -> Any:
        """The decoded image as an RGB PIL image (what the models' processors take)."""
        from PIL import Image as PILImage

        with PILImage.open(io.BytesIO(self.data)) as opened:
            return opened.convert("RGB")

    def data_url(self) -> str:
        """A ``data:`` URL of the bytes (OpenAI's ``image_url`` part)."""
        kind = "jpeg" if self.data[:3] == b"\xff\xd8\xff" else "png"
        return f"data:image/{kind};base64," + base64.b64encode(self.data).decode("ascii")


def to_image(value: Any, field: str = "images") -> Image:
    """An :class:`Image` from a PIL image, encoded bytes, a uint8 numpy array (H x W x 3, H x W
    x 4 or H x W), a ``data:`` URL, or an Image. Undecodable input raises InvalidRequest."""
    if isinstance(value, Image):
        return value
    if isinstance(value, str):
        value = _from_data_url(value, field)
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        _check_decodes(data, field)
        return Image(data)
    if hasattr(value, "__array_interface__") and hasattr(value, "dtype"):
        from PIL import Image as PILImage

        try:
            return Image(_encode_png(PILImage.fromarray(value)))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(field, f"an image array must be uint8 HxW, HxWx3 or HxWx4: {exc}") from exc
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        return Image(_encode_png(value))
    raise InvalidRequest(
        field, f"an image must be a PIL image, encoded bytes, a uint8 array or a data: URL, got {type(value).__name__}"
    )


def _check_decodes(data: bytes, field: str) -> None:
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(data)) as opened:
            opened.verify()
    except Exception as exc:
        raise InvalidRequest(field, f"the image bytes do not decode as an image: {exc}") from exc


def to_images(value: Any) -> tuple[Image, ...]:
    """``GenerateRequest.images``: a sequence of anything :func:`to_image` takes."""
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidRequest("images", f"must be a list of images, got {type(value).__name__}")
    if len(value) > MAX_IMAGES:
        raise InvalidRequest("images", f"at most {MAX_IMAGES} images per request, got {len(value)}")
    return tuple(to_image(item) for item in value)


@attrs.frozen
class TextPart:
    """A text part of a chat message's content."""

    text: str


@attrs.frozen
class ImagePart:
    """An image part of a chat message's content."""

    image: Image


ContentPart = TextPart | ImagePart


def to_part(value: Any, where: str) -> ContentPart:
    """A content part from a TextPart/ImagePart or OpenAI's dict shapes."""
    if isinstance(value, TextPart | ImagePart):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequest("messages", f"{where}: a content part must be a dict, got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text" and isinstance(value.get("text"), str):
        return TextPart(value["text"])
    if kind == "image_url":
        url = value.get("image_url")
        url = url.get("url") if isinstance(url, Mapping) else url
        if not isinstance(url, str):
            raise InvalidRequest("messages", f"{where}: image_url needs {{'url': 'data:...'}}")
        return ImagePart(to_image(url, "messages"))
    if kind == "image" and "image" in value:
        return ImagePart(to_image(value["image"], "messages"))
    raise InvalidRequest(
        "messages",
        f"{where}: unknown content part {dict(value)!r}; known: text, image_url (data: URL), image",
    )


def to_content(value: Any, where: str) -> str | tuple[ContentPart, ...]:
    """A message's content: a string, or a sequence of content parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        return tuple(to_part(part, f"{where} part {i}") for i, part in enumerate(value))
    raise InvalidRequest("content", f"{where}: must be a string or a list of content parts, got {value!r}")


def template_content(content: str | tuple[ContentPart, ...]) -> str | list[dict[str, Any]]:
    """What a chat template gets for a content: the string, or the parts with images as
    ``{"type": "image"}`` (the image itself goes to the engine beside the prompt)."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in content]


def content_images(content: str | tuple[ContentPart, ...]) -> tuple[Image, ...]:
    """The images of a content, in order."""
    return () if isinstance(content, str) else tuple(p.image for p in content if isinstance(p, ImagePart))


def collapse_image_runs(token_ids: Sequence[int], image_token_id: int) -> list[int]:
    """``token_ids`` with every run of ``image_token_id`` shortened to one token: the prompt an
    engine that expands each placeholder itself must get (vLLM expands *each* image token it
    sees, so an already-expanded prompt would be expanded twice)."""
    out: list[int] = []
    for token in token_ids:
        if token == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(token)
    return out


def image_runs(token_ids: Sequence[int], image_token_id: int) -> tuple[tuple[int, int], ...]:
    """(offset, length) of each run of ``image_token_id`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate([*token_ids, None]):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return tuple(runs)


@attrs.frozen
class MultiModalInfo:
    """What the engine made of a request's images (``Completion.multimodal``).

    ``placeholders[i]`` is (offset, length) of image i's tokens in the completion's
    ``prompt_token_ids`` (the expanded ids the engine saw); ``image_grid_thw[i]`` is the
    processor's (temporal, height, width) patch grid of image i (Qwen2-VL family; None for models
    whose processor reports none). A trainer's forward pass takes those prompt ids and
    ``processor.image_processor(images)``'s pixel values; the grid must equal its own.
    """

    image_token_id: int
    placeholders: tuple[tuple[int, int], ...]
    image_grid_thw: tuple[tuple[int, int, int], ...] | None = None


def image_token_id(model_dir: str) -> int | None:
    """The image placeholder token id in ``model_dir``'s config.json (``image_token_id`` or
    ``image_token_index``); None for a text-only model or a hub name without a local config."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    for key in ("image_token_id", "image_token_index"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def grid_thw(processor: Any, images: Sequence[Image]) -> tuple[tuple[int, int, int], ...] | None:
    """The processor's ``image_grid_thw`` for ``images`` (None when it reports none)."""
    if not images:
        return ()
    out = processor.image_processor(images=[image.to_pil() for image in images], return_tensors="np")
    grid = out.get("image_grid_thw")
    if grid is None:
        return None
    return tuple((int(t), int(h), int(w)) for t, h, w in grid.tolist())


@functools.lru_cache(maxsize=4)
def load_processor(model_dir: str) -> Any:
    """The Hugging Face processor of ``model_dir`` (cached per directory)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def placeholder_lengths(model_dir: str, images: Sequence[Image]) -> tuple[int, ...]:
    """How many image tokens each image becomes in ``model_dir``'s prompt (Qwen2-VL family: the
    processor's ``t * h * w`` patches over ``spatial_merge_size ** 2``)."""
    grids = grid_thw(load_processor(model_dir), images)
    if grids is None:
        raise InvalidRequest("images", f"the processor of {model_dir} reports no image_grid_thw")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    merge = int((config.get("vision_config") or {}).get("spatial_merge_size", 1))
    return tuple(t * h * w // merge**2 for t, h, w in grids)


def expand_image_runs(token_ids: Sequence[int], image_token_id: int, lengths: Sequence[int]) -> list[int]:
    """``token_ids`` with image ``i``'s placeholder (one image token, or a run of them) made a run
    of ``lengths[i]`` image tokens: the prompt as the engine sees it. InvalidRequest when the
    placeholders and the images do not pair up."""
    collapsed = collapse_image_runs(token_ids, image_token_id)
    count = sum(1 for t in collapsed if t == image_token_id)
    if count != len(lengths):
        raise InvalidRequest(
            "images",
            f"the prompt has {count} image placeholder(s) (runs of token {image_token_id}) for {len(lengths)} image(s)",
        )
    out: list[int] = []
    runs = iter(lengths)
    for token in collapsed:
        out.extend([token] * next(runs) if token == image_token_id else [token])
    return out


def checkpoint_names(model_dir: str | Path, runtime: Sequence[str]) -> dict[str, str]:
    """Runtime parameter name (``model.named_parameters()`` of a transformers 5 vision-language
    model) -> the name the checkpoint in ``model_dir`` stores it under, for the names that differ
    (:mod:`rlinfer_core.trainer_names`, which the engine facade also applies to every update)."""
    from rlinfer_core.trainer_names import name_map
    from rlinfer_core.transfer.disk import read_specs

    renamed = name_map(read_specs(str(model_dir))).renamed
    return {name: renamed[name] for name in runtime if name in renamed}
