"""Trajectory rows and shard files: schema, atomic writes, resumable manifest."""

from __future__ import annotations

import pyarrow.parquet as pq

from jfcore.contracts import TRAJECTORY_SCHEMA
from jfcore.decoding import DecodeConfig, decode
from jfcore.shards import (
    ShardRecord,
    completed_shards,
    plan_shards,
    record_shard,
    remove_stale_temporaries,
    run_key,
    write_shard,
)
from jfcore.trajectories import rows_to_table, trajectory_rows
from tests.support.tiny_models import greedy_reference, tiny_model

PROMPTS = [[7, 3, 9, 1], [5], [11, 12, 13]]


def decoded_rows(block_size: int = 6):
    m = tiny_model("qwen3")
    out = decode(
        m,
        PROMPTS,
        DecodeConfig(block_size=block_size, max_new_tokens=30, record_trajectories=True),
        eos_token_id=[],
        pad_token_id=0,
    )
    rows = []
    for i, (prompt, seq, blocks) in enumerate(zip(PROMPTS, out.sequences, out.trajectories)):
        rows += trajectory_rows(f"p{i}", prompt, seq, blocks, block_size, "model-fp", "tok-fp")
    return m, out, rows


def test_rows_hold_the_trajectory_invariants(tmp_path):
    m, _, rows = decoded_rows()
    table = rows_to_table(rows)
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    back = pq.read_table(path).to_pylist()
    assert back == rows
    for row in back:
        fixed = row["fixed_point"]
        assert row["context"][: row["prompt_length"]] == PROMPTS[int(row["prompt_id"][1:])]
        assert all(s[0] == fixed[0] for s in row["states"]) and row["states"][-1] == fixed
        assert row["first_mismatch"] == sorted(row["first_mismatch"]) and row["first_mismatch"][-1] == len(fixed)
        # The fixed point is the AR continuation of the block's context.
        assert greedy_reference(m, row["context"], len(fixed)) == fixed
    assert [r["last_block"] for r in back].count(True) == len(PROMPTS)


def test_plan_and_key():
    specs = plan_shards(10, 4)
    assert [(s.start, s.stop) for s in specs] == [(0, 4), (4, 8), (8, 10)]
    assert specs[1].name == "shard-00001.parquet"
    assert run_key(a=1, b=[1, 2]) == run_key(b=[1, 2], a=1) != run_key(a=2, b=[1, 2])


def test_manifest_resumes_and_detects_damage(tmp_path):
    _, _, rows = decoded_rows()
    specs = plan_shards(3, 2)
    first = write_shard(rows_to_table(rows[:3]), tmp_path, specs[0], prompts=2)
    record_shard(tmp_path, first, {"block_size": 6})
    # Shard 1 was written but the run died before the manifest listed it: it is redone.
    write_shard(rows_to_table(rows[3:]), tmp_path, specs[1], prompts=1)
    (tmp_path / ".shard-00001.parquet.abc.tmp").write_bytes(b"half a file")
    assert set(completed_shards(tmp_path, specs)) == {"shard-00000.parquet"}
    assert completed_shards(tmp_path, specs)["shard-00000.parquet"] == first
    remove_stale_temporaries(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    # A shard whose bytes changed no longer counts as complete.
    (tmp_path / "shard-00000.parquet").write_bytes(b"corrupt")
    assert completed_shards(tmp_path, specs) == {}
    assert isinstance(first, ShardRecord) and first.rows == 3


def test_a_slow_worker_does_not_hold_back_shards_another_could_make(tmp_path):
    """Shards go to whichever worker is free: with one worker ten times slower, the fast one makes most."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from jfcore.shards import ShardRecord, file_sha256, plan_shards
    from tasks.ray_workers import fill_shards

    pools = {"slow": ThreadPoolExecutor(1), "fast": ThreadPoolExecutor(1)}
    made_by: dict[str, str] = {}

    def make(worker: str, spec) -> ShardRecord:
        time.sleep(0.5 if worker == "slow" else 0.05)
        path = tmp_path / spec.name
        path.write_text(spec.name)
        made_by[spec.name] = worker
        return ShardRecord(spec.name, 1, 1, file_sha256(path))

    specs = plan_shards(12, 1)
    fill_shards(tmp_path, specs, ["slow", "fast"], lambda w, spec: pools[w].submit(make, w, spec), {}, lambda _: None)
    assert sorted(made_by) == sorted(s.name for s in specs)
    assert list(made_by.values()).count("slow") <= 2  # pre-assigned halves would have given it 6
