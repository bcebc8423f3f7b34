"""Tiny randomly initialised decoder-only models of several architectures."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 96
# A wide init makes the logits peaked, so float32 rounding differences between
# a one-token and a many-token forward cannot flip a greedy argmax by accident.
COMMON = {
    "vocab_size": VOCAB,
    "initializer_range": 0.3,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, **LLAMA_LIKE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, **LLAMA_LIKE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, **LLAMA_LIKE, head_dim=16)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, **LLAMA_LIKE, sliding_window=None)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(**COMMON, n_embd=64, n_layer=2, n_head=4, n_positions=512)),
}


def tiny_model(arch: str, seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]()
    model.config._attn_implementation = attn
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """What `generate(do_sample=False)` returns for one unpadded prompt (new tokens only)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def position_model(seed: int = 0) -> torch.nn.Module:
    """A GPT-2 whose token embeddings are zero: what it predicts depends only on
    positions and on which cache slots it attends to, never on the draft's
    content. So Jacobi drafts become exact after one update and whole blocks
    are accepted at once (long runs, block crossings, spawns), while any
    position-id or cache-slot mistake changes the output."""
    torch.manual_seed(seed)
    config = GPT2Config(**COMMON, n_embd=64, n_layer=2, n_head=4, n_positions=512, tie_word_embeddings=False)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


# A chat template in the tiny vocabulary: w3 opens a turn, w4 closes it, w5 starts the assistant's answer.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)


def save_tiny_checkpoint(
    path: Path, vocab_size: int = 128, seed: int = 0, initializer_range: float = 0.02, chat_template: str | None = None
) -> Path:
    """A random 2-layer Llama and a word-level tokenizer (words w0, w1, ...; no pad token; a chat template
    when given), saved like any checkpoint, for tests that load models by path."""
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
