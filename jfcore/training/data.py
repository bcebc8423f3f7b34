"""Packed shards as a training dataset with a seeded, resumable order."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jfcore.contracts import STATS


class TrainingDataError(ValueError):
    """The packed data cannot be trained on as configured."""


def packing_stats(folder: str | Path, tokenizer_fingerprint: str | None = None) -> dict:
    """The stats.json of a finished packing output, checked against the model's tokenizer."""
    folder = Path(folder)
    stats_file = folder / STATS
    if not stats_file.is_file():
        raise TrainingDataError(
            f"{folder} has no stats.json, so it is not a finished packing output; run packing into it first"
        )
    stats = json.loads(stats_file.read_text())
    made_with = stats.get("tokenizer_fingerprint")
    if tokenizer_fingerprint is not None and made_with is not None and made_with != tokenizer_fingerprint:
        raise TrainingDataError(
            f"{folder} was made with tokenizer fingerprint {made_with!r}, but the model's tokenizer has "
            f"{tokenizer_fingerprint!r}; train the model whose trajectories these are, or regenerate them"
        )
    return stats


class PackedData:
    """Every packed sequence of a packing output folder, in memory."""

    def __init__(self, folder: str | Path, tokenizer_fingerprint: str | None = None):
        folder = Path(folder)
        stats = packing_stats(folder, tokenizer_fingerprint)
        self.rows: list[dict] = []
        for name in stats["shards"]:
            try:
                self.rows += pq.read_table(folder / name).to_pylist()
            except (OSError, pa.ArrowException) as err:
                raise TrainingDataError(f"{folder / name}: unreadable packed shard ({err}); rerun packing") from err
        if len(self.rows) != stats["sequences"]:
            raise TrainingDataError(
                f"{folder}: stats.json counts {stats['sequences']} sequences but the shards "
                f"hold {len(self.rows)}; rerun packing"
            )
        self.block_size = self.rows[0]["block_size"] if self.rows else None
        self.fingerprint = hashlib.sha256(json.dumps(stats, sort_keys=True).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class DataOrder:
    """Which rows each (optimizer step, accumulation index, rank) trains on.

    Each epoch is a seeded permutation; every optimizer step takes the next
    global batch of micro_batch * world * accumulation rows (the epoch's
    remainder is dropped). The order is a pure function of the step, so a
    resumed run sees exactly the rows an uninterrupted one would have.
    """

    num_rows: int
    micro_batch: int
    world_size: int
    accumulation: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size * self.accumulation

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch

    def rows(self, step: int, accumulation_index: int, rank: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        start = within * self.global_batch + (accumulation_index * self.world_size + rank) * self.micro_batch
        return order[start : start + self.micro_batch].tolist()
