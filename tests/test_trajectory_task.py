"""Trajectory generation on a real local Ray into real Parquet shards: resumable, no duplicates."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tiny_models import save_tiny_checkpoint

from jfcore.hostspeed import scaled
from jfcore.models import ModelConfig, load_model, model_fingerprint
from jfcore.prompts import PromptSource
from jfcore.trajectories import TrajectoryConfig
from tasks.trajectories import RayConfig, generate_trajectories

NUM_PROMPTS = 8
TWO_RAY_WORKERS = RayConfig(num_workers=2)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a word-level tokenizer (words w0..w124), peaked logits."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), initializer_range=0.3)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "toy.jsonl"
    lines = [{"prompt": " ".join(f"w{(7 * i + j) % 120 + 3}" for j in range(3 + i))} for i in range(NUM_PROMPTS)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def run(tiny_checkpoint, prompt_file, out_dir, log=print, prompts_per_shard=2, ray=TWO_RAY_WORKERS):
    return generate_trajectories(
        ModelConfig(str(tiny_checkpoint)),
        PromptSource(path=str(prompt_file), field="prompt", chat_template=False),
        TrajectoryConfig(block_size=4, max_new_tokens=12, batch_size=2),
        ray,
        out_dir,
        prompts_per_shard=prompts_per_shard,
        log=log,
    )


def rows_of(folder: Path) -> list[dict]:
    return [r for f in sorted(folder.glob("shard-*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_generates_resumes_and_never_duplicates(tiny_checkpoint, prompt_file, tmp_path):
    folder = run(tiny_checkpoint, prompt_file, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 4
    rows = rows_of(folder)
    assert sum(s["rows"] for s in manifest["shards"].values()) == len(rows)
    keys = [(r["prompt_id"], r["block_index"]) for r in rows]
    assert len(set(keys)) == len(keys) and len({r["prompt_id"] for r in rows}) == NUM_PROMPTS
    model, _ = load_model(ModelConfig(str(tiny_checkpoint)))
    assert {r["model_fingerprint"] for r in rows} == {model_fingerprint(model)}
    for r in rows:
        assert r["states"][-1] == r["fixed_point"] and len(r["fixed_point"]) <= 4

    # A rerun finds every shard complete and rewrites nothing.
    mtimes = {f.name: f.stat().st_mtime_ns for f in folder.glob("shard-*.parquet")}
    lines: list[str] = []
    assert run(tiny_checkpoint, prompt_file, tmp_path, lines.append) == folder
    assert any("4/4 shards already complete, 0 to make" in line for line in lines)
    assert {f.name: f.stat().st_mtime_ns for f in folder.glob("shard-*.parquet")} == mtimes

    # A lost shard and a damaged one are redone, and only they; the result is the same rows.
    (folder / "shard-00001.parquet").unlink()
    (folder / "shard-00002.parquet").write_bytes(b"truncated")
    lines.clear()
    run(tiny_checkpoint, prompt_file, tmp_path, lines.append)
    assert any("2/4 shards already complete, 2 to make" in line for line in lines)
    assert (folder / "shard-00000.parquet").stat().st_mtime_ns == mtimes["shard-00000.parquet"]
    assert sorted(map(str, rows_of(folder))) == sorted(map(str, rows))


def test_without_ray_two_worker_processes_write_what_ray_writes(tiny_checkpoint, prompt_file, tmp_path):
    with_ray = run(tiny_checkpoint, prompt_file, tmp_path / "ray")
    lines: list[str] = []
    without = run(tiny_checkpoint, prompt_file, tmp_path / "none", lines.append, ray=RayConfig(address="none", num_workers=2))
    pids = [int(p) for p in re.search(r"2 workers ready \(pids \[(\d+), (\d+)\]\)", "\n".join(lines)).groups()]
    assert len(set(pids)) == 2 and os.getpid() not in pids  # each replica in a process of its own
    assert without.name == with_ray.name  # the same settings, so the same run key
    assert sorted(map(str, rows_of(without))) == sorted(map(str, rows_of(with_ray)))


def test_both_stages_run_as_prefect_tasks(tiny_checkpoint, prompt_file, tmp_path):
    from prefect import flow

    from tasks.packing import pack_trajectories_task
    from tasks.trajectories import generate_trajectories_task

    @flow
    def data_path() -> tuple[str, dict]:
        folder = generate_trajectories_task(
            model={"name_or_path": str(tiny_checkpoint)},
            prompts={"path": str(prompt_file), "field": "prompt", "chat_template": False},
            trajectory={"block_size": 4, "max_new_tokens": 8},
            ray={"num_workers": 1},
            out_dir=str(tmp_path / "trajectories"),
            prompts_per_shard=3,
        )
        return folder, pack_trajectories_task(folder, str(tmp_path / "packed"), {"window": 4})

    folder, stats = data_path()
    assert json.loads((Path(folder) / "manifest.json").read_text())["complete"]
    assert stats["sequences"] == NUM_PROMPTS and stats["blocks"] == len(rows_of(Path(folder)))
    assert (tmp_path / "packed" / "stats.json").is_file()


def test_packing_refuses_an_unfinished_run(tiny_checkpoint, prompt_file, tmp_path):
    from jfcore.packing import PackingConfig, PackingError
    from tasks.packing import pack_trajectories

    folder = run(tiny_checkpoint, prompt_file, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(PackingError, match="unfinished trajectory run"):
        pack_trajectories(folder, tmp_path / "packed", PackingConfig())


def kill_one_worker_midway(generate) -> Path:
    """Run `generate(log)` in a thread and SIGKILL one Ray worker as soon as the first shard lands."""
    lines: list[str] = []
    first_shard = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("shard 1/"):
            first_shard.set()

    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(folder=generate(log)))
    thread.start()
    assert first_shard.wait(timeout=scaled(600))
    ready = next(line for line in lines if "workers ready" in line)
    pids = [int(p) for p in re.findall(r"\d+", ready.split("pids")[1])]
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=scaled(900))
    return result["folder"]


def assert_same_rows_no_duplicates(folder: Path, expected: list[dict]) -> None:
    rows = rows_of(folder)
    keys = [(r["prompt_id"], r["block_index"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert sorted(map(str, rows)) == sorted(map(str, expected))


def test_a_killed_worker_loses_nothing(tiny_checkpoint, prompt_file, tmp_path):
    """Ray restarts the killed worker, its shards are redone, and the rows equal an undisturbed run's."""
    undisturbed = rows_of(run(tiny_checkpoint, prompt_file, tmp_path / "calm", prompts_per_shard=1))
    folder = kill_one_worker_midway(lambda log: run(tiny_checkpoint, prompt_file, tmp_path / "killed", log, 1))
    assert_same_rows_no_duplicates(folder, undisturbed)


@pytest.mark.slow
def test_smollm2_on_two_workers_survives_a_kill(tmp_path):
    """The real model on 32 of the project's prompts, 2 Ray workers, one killed mid-run."""

    def generate(out_dir, log=print):
        return generate_trajectories(
            ModelConfig(),
            PromptSource(limit=32),
            TrajectoryConfig(block_size=8, max_new_tokens=16, batch_size=4),
            RayConfig(num_workers=2),
            out_dir,
            prompts_per_shard=4,
            log=log,
        )

    undisturbed = rows_of(generate(tmp_path / "calm"))
    assert len({r["prompt_id"] for r in undisturbed}) == 32
    folder = kill_one_worker_midway(lambda log: generate(tmp_path / "killed", log))
    assert_same_rows_no_duplicates(folder, undisturbed)
    lines: list[str] = []
    generate(tmp_path / "killed", lines.append)  # a rerun finds everything done
    assert any("8/8 shards already complete, 0 to make" in line for line in lines)
