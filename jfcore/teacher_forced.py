"""Greedy Jacobi iterations of every block of a known text at once, teacher forced (docs/TRAINING.md).

With the text fixed, block j (size n) sits on the clean context before it (the prompt and the text up to its
start, prefilled once into a KV cache) whatever the model would have written there, so every block of a prompt
iterates in the same forward. A block's draft starts as the decoder's does (jfcore/decoding/rules/python.py):
the model's greedy next token, then seeded filler from one generator per prompt, drawn in block order. Each
iteration applies the Jacobi rule: the draft's first token and the run where draft[i+1] == argmax(logits[i]) are
verified, and the next draft is draft[0] followed by the fresh predictions.

Two users: the simulated TPF of jfcore.training.acceptance (forwards per block), and anchored trajectories
(`anchored_blocks`): the model's own iterates on each block of a reference text, whose fixed points are the
reference's blocks (an on-policy round that keeps the base model's text as its targets).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

import torch
from transformers import DynamicCache

from jfcore.decoding import BlockTrajectory


def prefill(model: torch.nn.Module, text: Sequence[int]) -> tuple[DynamicCache, list[int]]:
    """The KV cache of `text` and the model's greedy token after each of its prefixes (greedy[i]: after text[:i+1])."""
    device = next(model.parameters()).device
    cache = DynamicCache()
    logits = model(
        input_ids=torch.tensor([list(text)], device=device),
        position_ids=torch.arange(len(text), device=device)[None],
        past_key_values=cache,
        use_cache=True,
    ).logits[0]
    return cache, logits.argmax(-1).tolist()


def opening_drafts(
    text: Sequence[int],
    prompt_length: int,
    block_size: int,
    greedy: Sequence[int],
    seed: int,
    filler: Literal["context", "random"] = "context",
    vocab_size: int = 0,
) -> dict[int, list[int]]:
    """Block start -> its first draft, for every block of the text after the prompt (the last may be shorter)."""
    prompt = list(text[:prompt_length])
    rng, drafts = random.Random(f"{seed}:{prompt}"), {}
    for start in range(prompt_length, len(text), block_size):
        m = min(block_size, len(text) - start)
        guesses = (
            [rng.randrange(vocab_size) for _ in range(m - 1)]
            if filler == "random"
            else rng.choices(list(text[:start]), k=m - 1)
        )
        drafts[start] = [greedy[start - 1], *guesses]
    return drafts


def block_predictions(
    model: torch.nn.Module, cache: DynamicCache, length: int, drafts: dict[int, list[int]]
) -> dict[int, list[int]]:
    """One forward of every draft (block start -> draft) on the cached text of `length` tokens: block start -> the
    model's argmax at each of its positions. The cache is left holding the text alone."""
    parameter = next(model.parameters())
    device, low = parameter.device, torch.finfo(parameter.dtype).min
    order = sorted(drafts)
    inputs = [t for s in order for t in drafts[s]]
    starts = torch.tensor([s for s in order for _ in drafts[s]])
    q = torch.tensor([s + i for s in order for i in range(len(drafts[s]))])
    # Each query sees the clean text before its block and its block's earlier positions (and itself).
    context = torch.arange(length)[None, :] < starts[:, None]
    own = (starts[:, None] == starts[None, :]) & (q[None, :] <= q[:, None])
    seen = torch.cat([context, own], dim=1).to(device)
    mask = torch.zeros(seen.shape, dtype=parameter.dtype, device=device).masked_fill_(~seen, low)[None, None]
    out = model(
        input_ids=torch.tensor([inputs], device=device),
        position_ids=q[None].to(device),
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
    ).logits[0]
    cache.crop(-len(inputs))  # back to the text (crop takes how many to drop)
    predictions, at = out.argmax(-1).tolist(), 0
    result = {}
    for s in order:
        result[s] = predictions[at : at + len(drafts[s])]
        at += len(drafts[s])
    return result


def verified(draft: Sequence[int], predictions: Sequence[int]) -> int:
    """The Jacobi rule: how many of the draft's tokens one forward verifies (its first, then the matching run)."""
    accepted = 1
    while accepted < len(draft) and draft[accepted] == predictions[accepted - 1]:
        accepted += 1
    return accepted


def next_draft(draft: Sequence[int], predictions: Sequence[int]) -> list[int]:
    """The verified prefix, the correction, then fresh predictions: draft[0] and predictions[:-1]."""
    return [draft[0], *predictions[: len(draft) - 1]]


@torch.no_grad()
def anchored_blocks(
    model: torch.nn.Module,
    prompt: Sequence[int],
    reference: Sequence[int],
    block_size: int,
    seed: int = 0,
    filler: Literal["context", "random"] = "context",
) -> list[BlockTrajectory]:
    """Every block of `reference` (a response to `prompt`) with the states the model's greedy Jacobi iterations
    pass through on the reference's prefix, until the draft is the model's own fixed point there; each ends at
    the reference's block, appended where the model's own fixed point differs from it."""
    text, P = [*prompt, *reference], len(prompt)
    cache, greedy = prefill(model, text)
    vocab = model.get_output_embeddings().weight.shape[0] if filler == "random" else 0
    states = {s: [d] for s, d in opening_drafts(text, P, block_size, greedy, seed, filler, vocab).items()}
    open_blocks = {s for s, seq in states.items() if len(seq[0]) > 1}  # a 1-token draft is verified as it opens
    while open_blocks:
        drafts = {s: states[s][-1] for s in open_blocks}
        for s, predictions in block_predictions(model, cache, len(text), drafts).items():
            if verified(drafts[s], predictions) == len(drafts[s]):
                open_blocks.remove(s)
            else:
                states[s].append(next_draft(drafts[s], predictions))
    blocks = []
    for start, seq in sorted(states.items()):
        fixed = text[start : start + len(seq[0])]
        blocks.append(BlockTrajectory(start - P, seq if seq[-1] == fixed else [*seq, fixed]))
    return blocks
