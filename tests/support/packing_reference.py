"""Packing as it was first written: every row in memory, grouped by prompt, packed in prompt-id order and cut
into shards of `sequences_per_shard`. The streaming implementation must give the same rows."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jfcore.contracts import PACKED_SCHEMA
from jfcore.packing import REQUIRED_COLUMNS, PackingConfig, pack_prompt


def pack_in_memory(files: list[Path], config: PackingConfig) -> list[pa.Table]:
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for path in files:
        for row in pq.read_table(path, columns=list(REQUIRED_COLUMNS)).to_pylist():
            by_prompt[row["prompt_id"]].append(row)
    packed = [seq for pid in sorted(by_prompt) if (seq := pack_prompt(pid, by_prompt[pid], config)) is not None]
    step = config.sequences_per_shard
    return [pa.Table.from_pylist(packed[i : i + step], schema=PACKED_SCHEMA) for i in range(0, len(packed), step)]
