"""Packed shards as a training dataset with a seeded, resumable order."""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jfcore.atomic import atomic_write
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
    """The packed sequences of a packing output folder, memory-mapped: each shard is read once into an
    uncompressed Arrow file (`.arrow/<data fingerprint>/` in the folder, or a temporary folder where that is
    read-only), and only the rows a micro batch asks for become Python objects. Ranks on one machine share
    the mapped pages, and the operating system can drop them, so memory does not grow with the data set."""

    def __init__(self, folder: str | Path, tokenizer_fingerprint: str | None = None):
        folder = Path(folder)
        stats = packing_stats(folder, tokenizer_fingerprint)
        self.fingerprint = hashlib.sha256(json.dumps(stats, sort_keys=True).encode()).hexdigest()[:16]
        cache = _cache_folder(folder, self.fingerprint)
        self.tables: list[pa.Table] = []
        for name in stats["shards"]:
            try:
                mapped = _arrow_copy(folder / name, cache / f"{Path(name).stem}.arrow")
                self.tables.append(pa.ipc.open_file(pa.memory_map(str(mapped))).read_all())
            except (OSError, pa.ArrowException) as err:
                raise TrainingDataError(f"{folder / name}: unreadable packed shard ({err}); rerun packing") from err
        self.starts = np.cumsum([0] + [t.num_rows for t in self.tables])
        if len(self) != stats["sequences"]:
            raise TrainingDataError(
                f"{folder}: stats.json counts {stats['sequences']} sequences but the shards "
                f"hold {len(self)}; rerun packing"
            )
        self.block_size = self.take([0])[0]["block_size"] if len(self) else None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, indices: list[int]) -> list[dict]:
        """Rows by global index (shards in stats.json order), as Python dicts, in the order asked. One-row
        slices are zero-copy views of the mapped file (`Table.take` would gather across its chunks)."""
        shards = np.searchsorted(self.starts, indices, side="right") - 1
        rows = [self.tables[s].slice(i - int(self.starts[s]), 1) for i, s in zip(indices, shards.tolist())]
        return pa.concat_tables(rows).to_pylist()


def _cache_folder(folder: Path, fingerprint: str) -> Path:
    cache = folder / ".arrow" / fingerprint
    try:
        cache.mkdir(parents=True, exist_ok=True)
        return cache
    except OSError:  # a read-only packing folder: this process's own copy
        return Path(tempfile.mkdtemp(prefix=f"jf-packed-{fingerprint}-"))


def _arrow_copy(parquet: Path, arrow: Path) -> Path:
    """An uncompressed Arrow copy of a Parquet shard, written batch by batch (bounded memory) and renamed into
    place, so ranks converting the same shard at once all end with a whole file."""
    if not arrow.is_file():
        source = pq.ParquetFile(parquet)

        def convert(tmp: Path) -> None:
            with pa.ipc.new_file(str(tmp), source.schema_arrow) as writer:
                for batch in source.iter_batches(batch_size=1024):
                    writer.write_batch(batch)

        atomic_write(arrow, convert)
    return arrow


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
