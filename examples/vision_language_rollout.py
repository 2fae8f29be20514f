"""A vision-language rollout step end to end on CPU, with the tiny Qwen2-VL of rlinfer_core.tiny_vlm.

1. roll out a chat with an image part (vLLM in process);
2. rebuild the trainer's inputs from what came back - ``prompt_token_ids + token_ids`` (each image
   placeholder expanded exactly once) and the processor's pixel values of the same image - and
   check that the trainer's forward pass gives the engine's logprobs;
3. push new weights (vision tower and language model) and roll out again.

Run: ``.venvs/vllm/bin/python examples/vision_language_rollout.py`` (~1 min; the engine lock of
the shared dev machine: ``flock /tmp/rlinfer-engine.lock ...``). The demo has no image task: a
tiny random VLM learns nothing visible in CPU time, so this script shows the plumbing instead.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def main() -> None:
    """Roll out, check the trainer's logprobs against the engine's, update, roll out again."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlinfer_core import open_engine
    from rlinfer_core.multimodal import checkpoint_names
    from rlinfer_core.tiny_vlm import make_tiny_vlm, tiny_image
    from rlinfer_core.types import GenerateRequest, SamplingParams
    from rlinfer_core.weights import NamedTensors

    root = Path(tempfile.mkdtemp(prefix="rlinfer-vlm-"))
    policy_dir, trained_dir = make_tiny_vlm(root / "seed0", seed=0), make_tiny_vlm(root / "seed1", seed=1)
    image = tiny_image(0)
    chat = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is 2 + 3?"}],
        }
    ]
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    processor = AutoProcessor.from_pretrained(str(policy_dir))
    trainer = AutoModelForImageTextToText.from_pretrained(str(policy_dir), dtype=torch.float32).eval()

    with open_engine("vllm", model=str(policy_dir), dtype="float32", max_model_len=512) as engine:
        (done,) = engine.generate([GenerateRequest(messages=chat, sampling=sampling)])
        info = done.multimodal
        assert info is not None
        print("prompt ids (expanded once):", list(done.prompt_token_ids))
        print("image placeholders:", info.placeholders, "grid:", info.image_grid_thw)
        print("tokens:", list(done.token_ids))

        # the trainer's forward pass on exactly the engine's inputs
        ids = torch.tensor([[*done.prompt_token_ids, *done.token_ids]])
        pixels = processor.image_processor(images=[image], return_tensors="pt")
        assert [tuple(g) for g in pixels["image_grid_thw"].tolist()] == list(info.image_grid_thw or ())
        with torch.inference_mode():
            logits = trainer(input_ids=ids, mm_token_type_ids=(ids == info.image_token_id).long(), **pixels).logits
        start = len(done.prompt_token_ids) - 1
        logprobs = torch.log_softmax(logits[0, start : start + len(done.token_ids)].float(), dim=-1)
        picked = logprobs[torch.arange(len(done.token_ids)), torch.tensor(done.token_ids)]
        gap = (picked - torch.tensor(done.logprobs)).abs().max().item()
        print(f"max |trainer logprob - engine logprob| = {gap:.2e}")

        # a "training step": the other seed's weights, vision tower included, in checkpoint names
        trained = AutoModelForImageTextToText.from_pretrained(str(trained_dir), dtype=torch.float32)
        params = list(trained.named_parameters())
        names = checkpoint_names(trained_dir, [name for name, _ in params])
        version = engine.update_weights(NamedTensors.of([(names.get(n, n), p.detach()) for n, p in params]))
        (after,) = engine.generate([GenerateRequest(messages=chat, sampling=sampling)])
        print(f"weight version {version}: tokens {list(after.token_ids)}")


if __name__ == "__main__":
    main()
