"""Images in requests (capability ``generate.multimodal``) on the tiny Qwen2-VL of
:mod:`rlinfer_core.tiny_vlm`, against the HF oracle that runs the same processor.

The module opens an engine of its own on the tiny VLM (seed 0; seed 1 is the "trained" model).
A backend that does not claim ``generate.multimodal`` on its platform (before starting) or for
the started engine skips with its reason (the session engine's refusal of an image request is
``test_unsupported_capability_raises``). Checked: greedy tokens and logprobs with images against
the oracle, for a chat request with an image part and a token-id request with one placeholder;
the completion's prompt ids equal what the HF processor makes (placeholders expanded exactly
once), also when the expanded ids are sent back; ``Completion.multimodal`` (placeholder runs,
``image_grid_thw``); a full weight update of vision tower and language model over every local
transport, read back by checksums where claimed, and parity after it; a session with an image in
turn 1 and text after; ``score`` with an image.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.report import KitReport
from rlinfer_conformance.world import BASE, OTHER, EventRecorder, KitWorld, default_config, open_or_skip
from rlinfer_core.types import Capability, ChatMessage, Completion, GenerateRequest, SamplingParams

__all__ = [
    "rlinfer_multimodal_world",
    "test_images_match_the_oracle",
    "test_image_model_weight_updates",
    "test_session_with_an_image_then_text",
    "test_score_with_an_image",
]

#: checked on this module's own engine (the tiny VLM), not the session's text model
OWN_ENGINE_CAPABILITIES = (Capability.MULTIMODAL,)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
QUESTION = "what is 2 + 3?"


@pytest.fixture(scope="module")
def rlinfer_multimodal_world(
    rlinfer_backend: str,
    rlinfer_config_overrides: dict[str, Any],
    rlinfer_report: KitReport,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[KitWorld]:
    """An engine of its own on the tiny VLM, with the oracle of both seeds."""
    from rlinfer_conformance.oracle import Oracle, tie_band
    from rlinfer_conformance.world import LOGPROB_TOLERANCE
    from rlinfer_core.discovery import get_backend
    from rlinfer_core.tiny_vlm import make_tiny_vlm

    tmp = Path(tmp_path_factory.mktemp("rlinfer-kit-multimodal"))
    base_dir, other_dir = make_tiny_vlm(tmp / "vlm-seed0", seed=0), make_tiny_vlm(tmp / "vlm-seed1", seed=1)
    config = default_config(base_dir, rlinfer_config_overrides)
    why = f"{Capability.MULTIMODAL.value} not supported"
    platform = get_backend(rlinfer_backend).create(config).rlinfer_capabilities()
    if not platform.supports(Capability.MULTIMODAL):  # known before any engine starts
        pytest.skip(f"{why}: {platform.notes.get(Capability.MULTIMODAL.value, '')}")
    oracle = Oracle(weight_dtype=config.dtype, tie_tolerance=tie_band(LOGPROB_TOLERANCE))
    oracle.add(BASE, base_dir)
    oracle.add(OTHER, other_dir)
    events = EventRecorder()
    engine = open_or_skip(rlinfer_backend, config, rlinfer_report, "multimodal", why, [events])
    world = KitWorld(engine, oracle, rlinfer_report, events, tmp, architecture="qwen2_vl")
    try:
        if not world.supports(Capability.MULTIMODAL):
            note = engine.capabilities.notes.get(Capability.MULTIMODAL.value, "")
            pytest.skip(f"{why} for the tiny VLM: {note}")
        yield world
    finally:
        world.close()
        engine.shutdown()


def _images(seed: int) -> Any:
    from rlinfer_core.tiny_vlm import tiny_image

    return tiny_image(seed)


def _processor_ids(world: KitWorld, messages: list[dict[str, Any]], images: list[Any]) -> list[int]:
    """What the HF processor makes of a chat with images: placeholders expanded once."""
    processor = world.oracle.processor
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(processor(text=[text], images=images)["input_ids"][0])


def _check_info(world: KitWorld, completion: Completion, images: list[Any], where: str) -> None:
    processor = world.oracle.processor
    info = completion.multimodal
    assert info is not None, f"{where}: no Completion.multimodal for a request with images"
    grids = processor.image_processor(images=images, return_tensors="np")["image_grid_thw"].tolist()
    assert [list(g) for g in info.image_grid_thw or ()] == grids, f"{where}: image_grid_thw {info.image_grid_thw}"
    merge = processor.image_processor.merge_size
    lengths = [t * h * w // merge**2 for t, h, w in grids]
    assert [length for _, length in info.placeholders] == lengths, f"{where}: placeholders {info.placeholders}"
    for offset, length in info.placeholders:
        assert set(completion.prompt_token_ids[offset : offset + length]) == {info.image_token_id}, where


@pytest.mark.hooks("rlinfer_generate")
def test_images_match_the_oracle(rlinfer_multimodal_world: KitWorld) -> None:
    world = rlinfer_multimodal_world
    first, second = _images(0), _images(1)
    chat = [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": QUESTION}]}]
    chat_request = GenerateRequest(messages=chat, sampling=GREEDY, request_id=world.request_id("mm-chat"))
    expected = _processor_ids(
        world, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], [first]
    )
    tokenizer = world.oracle.processor.tokenizer
    one_placeholder = tokenizer.apply_chat_template(
        [ChatMessage("user", [{"type": "image", "image": second}, {"type": "text", "text": QUESTION}]).template_dict()],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids_request = GenerateRequest(
        prompt_token_ids=tokenizer.encode(one_placeholder, add_special_tokens=False),
        images=[second],
        sampling=GREEDY,
        request_id=world.request_id("mm-ids"),
    )
    by_chat, by_ids = world.generate([chat_request, ids_request])
    assert list(by_chat.prompt_token_ids) == expected, "prompt ids differ from the HF processor's (expanded once)"
    world.check_parity("multimodal", [chat_request, ids_request], [by_chat, by_ids])
    _check_info(world, by_chat, [first], "chat request")
    _check_info(world, by_ids, [second], "token-id request")
    assert by_chat.token_ids != by_ids.token_ids, "two different images gave the same output: images are ignored"
    # the expanded ids sent back (a next turn): expanded exactly once again, same output
    again = GenerateRequest(
        prompt_token_ids=by_chat.prompt_token_ids, images=[first], sampling=GREEDY, request_id=world.request_id("mm")
    )
    (resent,) = world.generate([again])
    assert resent.prompt_token_ids == by_chat.prompt_token_ids, "already-expanded placeholders were expanded again"
    assert resent.token_ids == by_chat.token_ids
    world.check_parity(None, [again], [resent])


@pytest.mark.hooks("rlinfer_update_weights", "rlinfer_weights_checksum")
def test_image_model_weight_updates(rlinfer_multimodal_world: KitWorld) -> None:
    """A full update (vision tower, merger and language model) over every local transport; the
    checksum readback covers the vision weights, and parity with an image follows the weights."""
    world = rlinfer_multimodal_world
    names = [name for name, _ in world.oracle.named_parameters(OTHER)]
    assert any(".visual." in f".{name}" for name in names), "the oracle's tensors hold no vision weights"
    image = _images(0)
    chat = [ChatMessage("user", [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}])]
    transports = world.local_transports()
    assert transports, "no local weight transport claimed"
    try:
        for transport in transports:
            for key in (OTHER, BASE):
                world.update(transport, key)  # verify_served: checksums of every tensor, vision ones included
                request = GenerateRequest(messages=chat, sampling=GREEDY, request_id=world.request_id("mm-w"))
                world.check_parity(f"multimodal_{transport.value}_{key}", [request], world.generate([request]))
    finally:
        world.restore()


@pytest.mark.hooks("rlinfer_generate")
def test_session_with_an_image_then_text(rlinfer_multimodal_world: KitWorld) -> None:
    """A session whose first user turn holds an image and whose next turn is text: each
    generation sees the session's tokens (placeholders expanded once, by the processor) and
    the image, and matches the oracle."""
    world = rlinfer_multimodal_world
    if not world.supports(Capability.SESSIONS):
        pytest.skip("sessions not supported")
    image = _images(0)
    content = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
    session = world.engine.session([{"role": "user", "content": content}], sampling=GREEDY)
    first = session.generate()
    expected = _processor_ids(
        world, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], [image]
    )
    assert first.completion is not None and list(first.completion.prompt_token_ids) == expected
    session.add_message("user", "and 3 + 4?")
    second = session.generate()
    assert second.completion is not None
    assert list(second.completion.prompt_token_ids) == list(session.token_ids[: second.start]), (
        "the engine saw other prompt ids than the session holds (placeholders expanded again?)"
    )
    for turn in (first, second):
        completion = turn.completion
        assert completion is not None
        request = GenerateRequest(
            prompt_token_ids=completion.prompt_token_ids,
            images=[image],
            sampling=GREEDY,
            request_id=completion.request_id,
        )
        world.check_parity("multimodal_session", [request], [completion])


@pytest.mark.hooks("rlinfer_generate")
def test_score_with_an_image(rlinfer_multimodal_world: KitWorld) -> None:
    """``engine.score`` of a completion with its image gives the oracle's logprobs, for the
    one-placeholder prompt and for the expanded one alike."""
    from rlinfer_conformance.world import LOGPROB_TOLERANCE
    from rlinfer_core.multimodal import to_image
    from rlinfer_core.scoring import ScoreRequest

    world = rlinfer_multimodal_world
    if not world.supports(Capability.SCORE):
        pytest.skip("score not supported")
    image = _images(1)
    chat = [ChatMessage("user", [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}])]
    request = GenerateRequest(messages=chat, sampling=GREEDY, request_id=world.request_id("mm-score"))
    (done,) = world.generate([request])
    tokenizer = world.oracle.processor.tokenizer
    one = tokenizer.encode(
        tokenizer.apply_chat_template([chat[0].template_dict()], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    oracle = world.oracle.logits(world.current, [*done.prompt_token_ids, *done.token_ids], [to_image(image)])
    import torch

    start = len(done.prompt_token_ids) - 1
    want = torch.log_softmax(oracle[start : start + len(done.token_ids)].double(), dim=-1)
    want = want[torch.arange(len(done.token_ids)), torch.tensor(done.token_ids)]
    for prompt in (one, done.prompt_token_ids):
        (score,) = world.engine.score([ScoreRequest(prompt, done.token_ids, images=[image])])
        assert score.prompt_token_ids == done.prompt_token_ids, "score's prompt is not the expanded-once prompt"
        gap = float((torch.tensor(score.logprobs, dtype=torch.float64) - want).abs().max())
        assert gap <= LOGPROB_TOLERANCE, f"score with an image differs from the oracle by {gap:.3g}"
