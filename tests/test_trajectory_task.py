"""Trajectory generation on a real local Ray into real Parquet shards: resumable, no duplicates."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from jfcore.models import ModelConfig, load_model, model_fingerprint
from jfcore.prompts import PromptSource
from jfcore.trajectories import TrajectoryConfig
from tasks.trajectories import RayConfig, generate_trajectories

NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a word-level tokenizer (words w0..w124), saved like any checkpoint."""
    path = tmp_path_factory.mktemp("tiny")
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(125)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.3)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "toy.jsonl"
    lines = [{"prompt": " ".join(f"w{(7 * i + j) % 120 + 3}" for j in range(3 + i))} for i in range(NUM_PROMPTS)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def run(tiny_checkpoint, prompt_file, out_dir, log=print, prompts_per_shard=2):
    return generate_trajectories(
        ModelConfig(str(tiny_checkpoint)),
        PromptSource(path=str(prompt_file), field="prompt", chat_template=False),
        TrajectoryConfig(block_size=4, max_new_tokens=12, batch_size=2),
        RayConfig(num_workers=2),
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
    assert any("4/4 shards already complete, 0 to generate" in line for line in lines)
    assert {f.name: f.stat().st_mtime_ns for f in folder.glob("shard-*.parquet")} == mtimes

    # A lost shard and a damaged one are redone, and only they; the result is the same rows.
    (folder / "shard-00001.parquet").unlink()
    (folder / "shard-00002.parquet").write_bytes(b"truncated")
    lines.clear()
    run(tiny_checkpoint, prompt_file, tmp_path, lines.append)
    assert any("2/4 shards already complete, 2 to generate" in line for line in lines)
    assert (folder / "shard-00000.parquet").stat().st_mtime_ns == mtimes["shard-00000.parquet"]
    assert sorted(map(str, rows_of(folder))) == sorted(map(str, rows))


def test_runs_as_a_prefect_task(tiny_checkpoint, prompt_file, tmp_path):
    from prefect import flow

    from tasks.trajectories import generate_trajectories_task

    @flow
    def only_trajectories() -> str:
        return generate_trajectories_task(
            model={"name_or_path": str(tiny_checkpoint)},
            prompts={"path": str(prompt_file), "field": "prompt", "chat_template": False},
            trajectory={"block_size": 4, "max_new_tokens": 8},
            ray={"num_workers": 1},
            out_dir=str(tmp_path),
            prompts_per_shard=3,
        )

    folder = Path(only_trajectories())
    assert json.loads((folder / "manifest.json").read_text())["complete"]
    assert len(rows_of(folder)) > NUM_PROMPTS


def test_a_killed_worker_loses_nothing(tiny_checkpoint, prompt_file, tmp_path):
    """SIGKILL one worker after the first shard lands: Ray restarts it, its shards are redone,
    and the rows equal an undisturbed run's, with no duplicates."""
    import os
    import re
    import signal
    import threading

    undisturbed = rows_of(run(tiny_checkpoint, prompt_file, tmp_path / "calm", prompts_per_shard=1))
    lines: list[str] = []
    first_shard = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("shard 1/"):
            first_shard.set()

    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(folder=run(tiny_checkpoint, prompt_file, tmp_path / "killed", log, 1))
    )
    worker.start()
    assert first_shard.wait(timeout=120)
    pids = [int(p) for p in re.findall(r"\d+", next(x for x in lines if "workers ready" in x).split("pids")[1])]
    os.kill(pids[1], signal.SIGKILL)
    worker.join(timeout=300)
    rows = rows_of(result["folder"])
    keys = [(r["prompt_id"], r["block_index"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert sorted(map(str, rows)) == sorted(map(str, undisturbed))
