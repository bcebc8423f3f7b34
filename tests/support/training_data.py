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
