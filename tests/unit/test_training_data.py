"""Packed shards as training data: memory-mapped Arrow copies, rows materialised only when asked for."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jfcore.packing import PackingConfig, pack_shards
from jfcore.training.data import PackedData, TrainingDataError
from tests.unit.test_packing import trajectories, write


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    prompts = [[(5 * i + j) % 90 + 1 for j in range(2 + i % 5)] for i in range(11)]
    _, rows = trajectories(4, 9, prompts=prompts)
    files = [write(root / "shard.parquet", [r for rs in rows.values() for r in rs])]
    stats = pack_shards(files, root / "out", PackingConfig(sequences_per_shard=4))
    return root / "out", stats


def test_rows_by_global_index_across_shards(packed):
    folder, stats = packed
    expected = pa.concat_tables([pq.read_table(folder / name) for name in stats.shards]).to_pylist()
    data = PackedData(folder)
    assert len(data) == len(expected) == 11 and len(data.tables) == 3
    order = [10, 0, 3, 4, 7, 8, 5]  # across every shard boundary
    assert data.take(order) == [expected[i] for i in order]
    assert data.block_size == 4
    assert all(t.num_rows for t in data.tables) and (folder / ".arrow" / data.fingerprint).is_dir()


def test_a_repacked_folder_gets_a_fresh_copy(packed, tmp_path):
    folder, _ = packed
    first = PackedData(folder)
    out = tmp_path / "repacked"
    prompts = [[3, 4, 5], [6, 7]]
    _, rows = trajectories(4, 9, prompts=prompts)
    pack_shards([write(tmp_path / "s.parquet", [r for rs in rows.values() for r in rs])], out, PackingConfig())
    again = PackedData(out)
    assert again.fingerprint != first.fingerprint and len(again) == 2


def test_a_truncated_shard_is_a_clear_error(packed, tmp_path):
    folder, stats = packed
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in [*stats.shards, "stats.json"]:
        (broken / name).write_bytes((folder / name).read_bytes())
    shard = broken / stats.shards[1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(TrainingDataError, match="unreadable packed shard"):
        PackedData(broken)
