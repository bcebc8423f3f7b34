"""Packed training data made the real way: Jacobi trajectories of a checkpoint, packed by jfcore.packing."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq

from jfcore.models import ModelConfig, load_model, model_fingerprint, tokenizer_fingerprint
from jfcore.packing import PackingConfig, pack_shards
from jfcore.trajectories import TrajectoryConfig, decode_trajectories


def packed_data(
    checkpoint: Path,
    out: Path,
    prompts: int = 16,
    block_size: int = 4,
    max_new_tokens: int = 12,
    seed: int = 0,
    heldout: PackingConfig | None = None,
) -> Path:
    """Decode `prompts` random word prompts (ids p0, p1, ...) with `checkpoint` and pack them into `out`; `heldout`:
    the packing settings that hold some of them out."""
    model, tokenizer = load_model(ModelConfig(name_or_path=str(checkpoint)))
    rng = random.Random(seed)
    vocab = len(tokenizer) - 3
    token_ids = [
        tokenizer(" ".join(f"w{rng.randrange(vocab)}" for _ in range(rng.randrange(3, 9))))["input_ids"]
        for _ in range(prompts)
    ]
    table = decode_trajectories(
        model,
        [f"p{i}" for i in range(prompts)],
        token_ids,
        TrajectoryConfig(block_size=block_size, max_new_tokens=max_new_tokens, batch_size=8),
        model_fingerprint(model),
        tokenizer_fingerprint(tokenizer),
    )
    shard = out / "trajectories" / "shard-00000.parquet"
    shard.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, shard)
    config = PackingConfig(pad_token_id=tokenizer.pad_token_id)
    if heldout is not None:
        config = PackingConfig(
            pad_token_id=tokenizer.pad_token_id,
            heldout_fraction=heldout.heldout_fraction,
            heldout_seed=heldout.heldout_seed,
        )
    pack_shards([shard], out / "packed", config)
    return out / "packed"


def packed_row(prompt: list[int], blocks: list[tuple[list[int], list[int]]], mismatch: list[int], n: int, pad: int = 0):
    """A packed row built by hand: `blocks` are (noisy, clean) pairs of equal valid length <= n, padded with `pad`;
    `mismatch` is each block's first mismatch."""
    ids, pos, P = list(prompt), list(range(len(prompt))), len(prompt)
    for j, (k, l) in enumerate(blocks):
        fill = [pad] * (n - len(l))
        ids += k + fill + l + fill
        pos += list(range(P + j * n, P + (j + 1) * n)) * 2
    return {
        "prompt_id": "p",
        "input_ids": ids,
        "position_ids": pos,
        "prompt_length": P,
        "block_size": n,
        "num_blocks": len(blocks),
        "first_mismatch": mismatch,
        "valid_lengths": [len(l) for _, l in blocks],
    }
