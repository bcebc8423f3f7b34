"""Trajectory generation on a real local Ray into real Parquet shards: resumable, incremental, no duplicates."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jfcore.config import ConfigError
from jfcore.hostspeed import scaled
from jfcore.models import ModelConfig, load_model, model_fingerprint
from jfcore.prompts import PromptSource
from jfcore.trajectories import TrajectoryConfig
from tasks.trajectories import RayConfig, generate_trajectories
from tests.support.tiny_models import save_tiny_checkpoint

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


def run(tiny_checkpoint, prompt_file, out_dir, log=print, prompts_per_shard=2, ray=TWO_RAY_WORKERS, anchor=None):
    return generate_trajectories(
        ModelConfig(name_or_path=str(tiny_checkpoint)),
        PromptSource(path=str(prompt_file), field="prompt", chat_template=False),
        TrajectoryConfig(block_size=4, max_new_tokens=12, batch_size=2),
        ray,
        out_dir,
        prompts_per_shard=prompts_per_shard,
        log=log,
        anchor=anchor,
    )


def rows_of(selection: Path) -> list[dict]:
    """The rows a selection file names: its prompts, from the shards it says hold them."""
    chosen = json.loads(selection.read_text())
    store = Path(chosen["store"])
    return [
        r
        for name, ids in sorted(chosen["shards"].items())
        for r in pq.read_table(store / name).to_pylist()
        if r["prompt_id"] in ids
    ]


def store_of(selection: Path) -> Path:
    return selection.parent.parent


def test_generates_resumes_and_never_duplicates(tiny_checkpoint, prompt_file, tmp_path):
    selection = run(tiny_checkpoint, prompt_file, tmp_path)
    folder = store_of(selection)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["shards"]) == 4 and sum(len(s["keys"]) for s in manifest["shards"].values()) == NUM_PROMPTS
    rows = rows_of(selection)
    assert sum(s["rows"] for s in manifest["shards"].values()) == len(rows)
    keys = [(r["prompt_id"], r["block_index"]) for r in rows]
    assert len(set(keys)) == len(keys) and len({r["prompt_id"] for r in rows}) == NUM_PROMPTS
    model, _ = load_model(ModelConfig(name_or_path=str(tiny_checkpoint)))
    assert {r["model_fingerprint"] for r in rows} == {model_fingerprint(model)}
    for r in rows:
        assert r["states"][-1] == r["fixed_point"] and len(r["fixed_point"]) <= 4

    # A rerun finds every prompt decoded, starts no worker and rewrites nothing.
    mtimes = {f.name: f.stat().st_mtime_ns for f in folder.glob("shard-*.parquet")}
    lines: list[str] = []
    assert run(tiny_checkpoint, prompt_file, tmp_path, lines.append) == selection
    assert any(
        f"{NUM_PROMPTS} already decoded with this model and settings (reused), 0 to decode" in line for line in lines
    )
    assert not any("workers ready" in line for line in lines)
    assert {f.name: f.stat().st_mtime_ns for f in folder.glob("shard-*.parquet")} == mtimes

    # The prompts of a lost shard and a damaged one are decoded again, and only they; the rows are the same.
    (folder / "shard-00001.parquet").unlink()
    (folder / "shard-00002.parquet").write_bytes(b"truncated")
    lines.clear()
    run(tiny_checkpoint, prompt_file, tmp_path, lines.append)
    assert any("4 already decoded with this model and settings (reused), 4 to decode" in line for line in lines)
    assert (folder / "shard-00000.parquet").stat().st_mtime_ns == mtimes["shard-00000.parquet"]
    assert not (folder / "shard-00002.parquet").exists()  # the damaged file is gone with its manifest entry
    assert sorted(map(str, rows_of(selection))) == sorted(map(str, rows))


def test_appended_and_edited_prompts_are_the_only_ones_decoded(tiny_checkpoint, prompt_file, tmp_path):
    from jfcore.packing import PackingConfig
    from tasks.packing import pack_trajectories

    grown = tmp_path / "prompts.jsonl"  # ids are the source's name and row: the file stays where it is
    lines = prompt_file.read_text().splitlines()
    grown.write_text(prompt_file.read_text())
    first = run(tiny_checkpoint, grown, tmp_path)
    edited = [json.dumps({"prompt": "w5 w6 w7 w8 w9"})]  # prompt 0 changes its text, keeping its id
    added = [json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) for i in (10, 40, 70)]
    grown.write_text("\n".join(edited + lines[1:] + added) + "\n")
    log: list[str] = []
    second = run(tiny_checkpoint, grown, tmp_path, log.append)
    assert store_of(second) == store_of(first)  # same model and settings: the same store
    assert any(
        f"{NUM_PROMPTS - 1} already decoded with this model and settings (reused), 4 to decode" in line for line in log
    )
    chosen = json.loads(second.read_text())
    assert chosen["num_prompts"] == NUM_PROMPTS + 3 and chosen["decoded"] == 4
    rows = rows_of(second)
    assert len({r["prompt_id"] for r in rows}) == NUM_PROMPTS + 3
    ids = [r["prompt_id"] for r in rows if r["block_index"] == 0]
    assert len(ids) == len(set(ids))  # the old text of prompt 0 is not selected beside the new one
    stats = pack_trajectories(second, tmp_path / "packed", PackingConfig(window=4))
    assert stats["sequences"] == NUM_PROMPTS + 3 and stats["blocks"] == len(rows)


def test_without_ray_two_worker_processes_write_what_ray_writes(tiny_checkpoint, prompt_file, tmp_path):
    with_ray = run(tiny_checkpoint, prompt_file, tmp_path / "ray")
    lines: list[str] = []
    without = run(
        tiny_checkpoint, prompt_file, tmp_path / "none", lines.append, ray=RayConfig(address="none", num_workers=2)
    )
    pids = [int(p) for p in re.search(r"2 workers ready \(pids \[(\d+), (\d+)\]\)", "\n".join(lines)).groups()]
    assert len(set(pids)) == 2 and os.getpid() not in pids  # each replica in a process of its own
    assert store_of(without).name == store_of(with_ray).name  # the same settings, so the same store key
    assert sorted(map(str, rows_of(without))) == sorted(map(str, rows_of(with_ray)))


def test_an_anchored_store_keeps_the_anchors_text_as_its_fixed_points(tiny_checkpoint, prompt_file, tmp_path):
    """Another model anchored to the first one's trajectories: its rows sit on the first model's text and end at
    its blocks, in a store of their own; a prompt the anchor lacks is refused by name."""
    other = save_tiny_checkpoint(tmp_path / "other", seed=1, initializer_range=0.3)
    none = RayConfig(address="none")
    anchor = run(tiny_checkpoint, prompt_file, tmp_path / "base", ray=none)
    free = run(other, prompt_file, tmp_path / "round", ray=none)
    anchored = run(other, prompt_file, tmp_path / "round", ray=none, anchor=anchor)
    assert store_of(anchored) != store_of(free)
    assert json.loads(anchored.read_text())["settings"]["anchored"] is True
    key = lambda r: (r["prompt_id"], r["block_index"])
    base, own, rows = (sorted(rows_of(s), key=key) for s in (anchor, free, anchored))
    assert [(key(r), r["context"], r["fixed_point"]) for r in rows] == [
        (key(r), r["context"], r["fixed_point"]) for r in base
    ]
    assert [r["fixed_point"] for r in own] != [r["fixed_point"] for r in base]  # the other model writes other text
    assert all(r["first_mismatch"][-1] == len(r["fixed_point"]) for r in rows)

    grown = tmp_path / "grown" / prompt_file.name  # the same ids, and one more prompt
    grown.parent.mkdir()
    grown.write_text(prompt_file.read_text() + json.dumps({"prompt": "w9 w8 w7"}) + "\n")
    with pytest.raises(ConfigError, match=r"prompt 'toy:8' is not in the anchor's trajectories"):
        run(other, grown, tmp_path / "round", ray=none, anchor=anchor)


def test_both_stages_run_as_prefect_tasks(tiny_checkpoint, prompt_file, tmp_path):
    from prefect import flow

    from jfcore.packing import PackingConfig
    from jfcore.training.config import TrainConfig
    from tasks.packing import PackingResult, packing_task
    from tasks.plan import StagePlan
    from tasks.tracking import TrackingConfig
    from tasks.trajectories import TrajectoriesResult, trajectories_task

    model = ModelConfig(name_or_path=str(tiny_checkpoint))
    plan = StagePlan(
        "training",
        "",
        tmp_path,
        model,
        PromptSource(path=str(prompt_file), field="prompt", chat_template=False),
        TrajectoryConfig(block_size=4, max_new_tokens=8),
        PackingConfig(window=4),
        TrainConfig(data="-", output_dir="-", model=model),
    )

    @flow
    def data_path(run: bool) -> tuple[TrajectoriesResult, PackingResult]:
        trajectories = trajectories_task(plan, RayConfig(num_workers=1), 3, TrackingConfig(), run)
        return trajectories, packing_task(plan, trajectories.selection, TrackingConfig(), run)

    trajectories, packing = data_path(True)
    assert Path(trajectories.selection).parent.parent.parent == tmp_path / "trajectories"
    assert trajectories.read().num_prompts == NUM_PROMPTS and trajectories.ran
    stats = packing.stats
    assert stats["sequences"] == NUM_PROMPTS and stats["blocks"] == len(rows_of(Path(trajectories.selection)))
    assert Path(packing.folder).parent == tmp_path / "packing" and not packing.reused
    assert (Path(packing.folder) / "stats.json").is_file()
    # Skipped, the stages hand on what the last run wrote.
    skipped, reused = data_path(False)
    assert skipped == TrajectoriesResult(trajectories.selection, ran=False)
    assert reused == PackingResult(packing.folder, stats, reused=True)


def test_packing_refuses_an_unfinished_run(tiny_checkpoint, prompt_file, tmp_path):
    from jfcore.packing import PackingConfig, PackingError
    from tasks.packing import pack_trajectories

    folder = store_of(run(tiny_checkpoint, prompt_file, tmp_path))  # a run folder written by earlier versions
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
def test_smollm2_on_two_workers_survives_a_kill(tmp_path, monkeypatch):
    """The real model on 32 of the project's prompts, 2 Ray workers, one killed mid-run; its trajectories,
    each prompt's blocks spread over three shards, pack through several spill buckets exactly as they do
    when every row is held in memory."""

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
    assert any("32 already decoded with this model and settings (reused), 0 to decode" in line for line in lines)

    import jfcore.packing
    from jfcore.packing import PackingConfig, pack_shards
    from jfcore.trajectories import rows_to_table
    from tests.support.packing_reference import pack_in_memory

    spread = [tmp_path / f"spread-{s}.parquet" for s in range(3)]
    for s, path in enumerate(spread):
        pq.write_table(rows_to_table(undisturbed[s::3]), path)
    monkeypatch.setattr(jfcore.packing, "PROMPTS_PER_BUCKET", 5)
    config = PackingConfig(sequences_per_shard=10)
    stats = pack_shards(spread, tmp_path / "packed", config)
    expected = pack_in_memory(spread, config)
    assert len(stats.shards) == len(expected) == 4
    for name, table in zip(stats.shards, expected):
        assert pq.read_table(tmp_path / "packed" / name).to_pylist() == table.to_pylist()
