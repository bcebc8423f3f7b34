"""A tiny random Llama with a byte-level tokenizer and a ChatML template: the smoke campaign's model.

Any text encodes (as UTF-8 bytes) and decodes back, the chat template is the one SmolLM2
uses, and the whole checkpoint is built in about a second, so the campaign's smoke
profile runs every stage on real prompts and benchmarks without a download.

    python -m bench.tiny_model runs/tiny-model
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL, *alphabet])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
        padding_side="left",
    )


def make_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Save the tiny model and its tokenizer to `path` (a checkpoint any loader in the project reads)."""
    path = Path(path)
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-model"))
