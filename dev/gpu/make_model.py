"""Make a ~0.6B-parameter random bf16 Llama model dir for the GPU runs (no hub on the device).

Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, MLP 4864, vocab
151936) in the Llama architecture with untied embeddings: 630M parameters, 1.26 GB in bf16 --
big enough for a weight-sync GB/s figure, small enough to make in ~20 s. Built with
``rlinfer_core.tiny_model.make_tiny_model`` (same tokenizer and chat template as the CPU tests);
the tokenizer's vocabulary is then padded with plain filler tokens up to the model's vocab size,
so every token id an engine samples can be detokenized.

    python3 dev/gpu/make_model.py /tmp/rlinfer_model [--layers 24] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def pad_tokenizer(model_dir: Path, vocab_size: int) -> int:
    """Add filler tokens to tokenizer.json until its vocab has ``vocab_size`` ids; return how many."""
    path = model_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    added = 0
    for token_id in range(vocab_size):
        if token_id not in used:
            vocab[f"<x{token_id}>"] = token_id
            added += 1
    path.write_text(json.dumps(data, ensure_ascii=False))
    return added


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)

    from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model

    if (args.out / "rlinfer_tiny_model.json").exists():
        print(f"make_model: {args.out} exists, reusing it")
        return 0
    spec = TinyModelSpec(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_len,
        dtype=args.dtype,
    )
    started = time.perf_counter()
    make_tiny_model(args.out, seed=args.seed, spec=spec)
    added = pad_tokenizer(args.out, args.vocab)
    size = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    print(
        f"make_model: {args.out}: {size / 1e9:.2f} GB of {args.dtype} weights, "
        f"{added} filler tokens, {time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
