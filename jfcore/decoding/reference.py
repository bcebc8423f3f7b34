"""The references every decoder is compared with: HF `generate` (greedy), and sequential sampling.

Each of the project's decoders must return exactly these tokens in float32;
evaluation and benchmarks measure speedups against `generate`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jfcore.decoding.runner.slots import left_pad
from jfcore.decoding.sampling import Sampling, choose


def hf_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    **generate_kwargs,
) -> list[list[int]]:
    """Greedy HF `generate` on token-id prompts (left-padded into one batch).

    Returns the new tokens per prompt, cut after the first EOS like `decode`'s output.
    Extra keyword arguments go to `generate` (e.g. `prompt_lookup_num_tokens=10`, or `do_sample=True` with a
    temperature for HF's own sampling).
    """
    device = next(model.parameters()).device
    ids, mask, _ = left_pad(prompts, pad_token_id)
    width = ids.shape[1]
    with torch.inference_mode():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.long().to(device),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_token_ids),
            pad_token_id=pad_token_id,
            **{"do_sample": False, "num_beams": 1, **generate_kwargs},
        )
    return [cut_at_eos(row[:max_new_tokens], eos_token_ids) for row in out[:, width:].tolist()]


def cut_at_eos(tokens: list[int], eos_token_ids: Sequence[int]) -> list[int]:
    """`tokens` up to and including the first EOS."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos_token_ids), len(tokens))
    return tokens[:end]


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """Index of the first token that differs from the reference (the length when they are equal)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


@torch.inference_mode()
def sample_sequentially(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling,
    sample: int = 0,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """Token-by-token sampling with the same keyed noise, one full forward (no cache) per token: the definition
    every method's sampled output must equal."""
    device = next(model.parameters()).device
    tokens: list[int] = []
    for t in range(max_new_tokens):
        logits = model(torch.tensor([[*prompt, *tokens]], device=device)).logits[:, -1:]
        tokens.append(int(choose(logits, [sampling], [sample], torch.tensor([[t]]))[0, 0]))
        if tokens[-1] in eos_token_ids:
            break
    return tokens
