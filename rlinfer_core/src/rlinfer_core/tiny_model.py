"""Tiny causal LMs in several architectures, made on the fly (no hub access needed).

``make_tiny_model(dir, seed=0, spec)`` writes a complete Hugging Face model directory: config,
safetensors weights (random, deterministic from ``seed``), a byte-level BPE tokenizer trained
offline on the small corpus below, and a chat template. head_dim is 64 (CPU attention kernels
reject smaller). Used by the tests, the conformance kit and the demo.

Architectures (``TinyModelSpec.architecture``), chosen for the layouts that trip weight loaders:

- ``llama``: untied output head, no biases;
- ``qwen2``: q/k/v biases and the output head tied to the embedding (Qwen2.5-0.5B..3B,
  Llama-3.2-1B/3B and Gemma tie theirs);
- ``qwen3``: per-head q/k RMSNorms, untied head;
- ``qwen3_moe``: Qwen3-MoE (Qwen3-30B-A3B's layout): 8 experts, top-2 with renormalised
  weights, per-head q/k norms - experts are fused into one tensor per layer by both engines;
- ``qwen2_moe``: Qwen2-MoE: top-2 of 8 experts plus a shared expert behind a sigmoid gate,
  q/k/v biases;
- ``mixtral``: Mixtral's ``block_sparse_moe`` (``w1``/``w2``/``w3`` expert names), untied head;
- ``gemma``: a tied and scaled embedding, RMSNorm as ``1 + weight``, GeGLU;
- ``mistral``: Mistral (Llama's layout under another name, sliding window off);
- ``phi3``: q/k/v and gate/up fused *in the checkpoint* (``qkv_proj``, ``gate_up_proj``).

Biases and norm weights are randomised too (transformers initialises them to 0 and 1), so a
loader that skips them changes the outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

CORPUS = """\
The quick brown fox jumps over the lazy dog. A rollout engine generates tokens; a trainer
scores them, takes a gradient step, and pushes the new weights back into the engine.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30.
Question: what is 2 + 3? Answer: 5. Question: what is 7 + 8? Answer: 15.
user: hello there. assistant: hello! how can I help you today?
Reinforcement learning from verifiable rewards: the reward is 1 when the answer is right.
abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'"()[]{}<>+-*/=_#@%&
"""

#: without tools and tool calls this renders exactly as the first template did; ``tools`` add a
#: system turn listing them, an assistant message's ``tool_calls`` render in the hermes format
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You may call these tools, one call per <tool_call></tool_call>: "
    "{{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}"
    "<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]


@attrs.frozen
class TinyModelSpec:
    """Shape of the tiny model. Defaults: ~0.2M parameters, float32."""

    vocab_size: int = 384
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 1024
    init_std: float = 0.02
    dtype: str = "float32"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    architecture: str = attrs.field(default="llama")

    @architecture.validator
    def _known(self, _attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {value!r}; known: {list(ARCHITECTURES)}")


#: the architectures :func:`make_tiny_model` can write
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma", "mistral", "phi3")
#: those whose feed-forward layers are mixtures of experts
MOE_ARCHITECTURES = frozenset({"qwen3_moe", "qwen2_moe", "mixtral"})


def _config(spec: TinyModelSpec, tokenizer: object) -> object:
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        torch_dtype=spec.dtype,
    )
    experts = dict(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok)
    moe_size = spec.intermediate_size // 2
    match spec.architecture:
        case "qwen2":
            return transformers.Qwen2Config(tie_word_embeddings=True, **common)
        case "qwen3":
            return transformers.Qwen3Config(tie_word_embeddings=False, attention_bias=False, **common)
        case "qwen3_moe":
            return transformers.Qwen3MoeConfig(
                tie_word_embeddings=False,
                attention_bias=False,
                moe_intermediate_size=moe_size,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                **experts,
                **common,
            )
        case "qwen2_moe":
            return transformers.Qwen2MoeConfig(
                tie_word_embeddings=False,
                moe_intermediate_size=moe_size,
                shared_expert_intermediate_size=spec.intermediate_size,
                norm_topk_prob=False,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                **experts,
                **common,
            )
        case "mixtral":
            return transformers.MixtralConfig(
                tie_word_embeddings=False,
                num_local_experts=spec.num_experts,
                num_experts_per_tok=spec.num_experts_per_tok,
                sliding_window=None,
                **common,
            )
        case "gemma":
            # exact GeLU (the first Gemma release): SGLang's Gemma computes it whatever the config says
            return transformers.GemmaConfig(tie_word_embeddings=True, hidden_activation="gelu", **common)
        case "mistral":
            return transformers.MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)
        case "phi3":
            return transformers.Phi3Config(tie_word_embeddings=False, **common)
        case _:
            return transformers.LlamaConfig(tie_word_embeddings=False, **common)


def _randomise_biases_and_norms(model: object, std: float, norm_centre: float = 1.0) -> None:
    """Biases and norm weights away from their 0 and ``norm_centre`` starts; routers scaled up so
    that their top-k choice is decisive (near-ties between experts would flip on rounding noise)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            if name.endswith(".bias"):
                param.normal_(0.0, std)
            elif "norm" in name:
                param.normal_(norm_centre, 0.1)
            elif name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                param.normal_(0.0, 0.5)


def _train_tokenizer(vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def make_tiny_model(path: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny random model directory (``spec.architecture``) at ``path`` and return it.

    The same ``seed`` and ``spec`` always give the same weights and tokenizer; a different seed
    gives different weights with the same tokenizer and shapes (a "second model" for weight
    updates).
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    spec = spec or TinyModelSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec.vocab_size),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config = _config(spec, tokenizer)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, spec.dtype))
        if spec.architecture != "llama":  # the llama weights stay as earlier releases made them
            # Gemma scales by 1 + w: its norms start at 0 so that the served scale is near 1 as elsewhere
            _randomise_biases_and_norms(model, spec.init_std, 0.0 if spec.architecture == "gemma" else 1.0)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out, safe_serialization=True)
    (out / "rlinfer_tiny_model.json").write_text(json.dumps({"seed": seed, **attrs.asdict(spec)}, indent=1))
    return out
