"""The campaign command end to end on its smoke profile, and the block-size curriculum in the campaign and the flow."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.campaign import load_campaign
from bench.tiny_model import make_tiny_model
from flows.jacobi_forcing import jacobi_forcing
from jfcore.config import ConfigError, to_dict
from jfcore.hostspeed import scaled
from jfcore.models import ModelConfig, load_model, model_fingerprint
from tests.support import REPO


def without_orchestration(folder: Path) -> Path:
    """This environment's packages minus Prefect, Ray and MLflow: a machine where they are not installed."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    folder.mkdir()
    for entry in site.iterdir():
        if not re.match(r"(prefect|ray|mlflow)([-_.]|$)", entry.name.lower()):
            (folder / entry.name).symlink_to(entry)
    return folder


def campaign(work: Path, *args: str) -> subprocess.CompletedProcess:
    site = work.parent / "site-packages"
    if not site.exists():
        without_orchestration(site)
    # -S: no site-packages but those on PYTHONPATH (the training processes it launches see the full environment)
    command = [
        sys.executable,
        "-S",
        "-m",
        "bench.campaign",
        "--profile",
        "smoke",
        "--set",
        f"work_dir={work}",
        "--set",
        f"model.name_or_path={work / 'tiny-model'}",
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(site)]))
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(900), check=False)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    work = tmp_path_factory.mktemp("campaign") / "work"
    first = campaign(work)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    return work, first.stdout


def fingerprint(path: Path) -> str:
    return model_fingerprint(load_model(ModelConfig(str(path)))[0])


def test_every_phase_runs_without_orchestration_and_writes_the_report(smoke):
    work, out = smoke
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import prefect"],
        env={"PYTHONPATH": str(work.parent / "site-packages")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert "No module named 'prefect'" in probe.stderr  # the campaign ran where Prefect is not installed
    assert "Started a local Ray" not in out  # the profile runs each stage's worker in this process
    assert re.search(r"step 4/4: loss [\d.]+ \(ar [\d.]+, consistency [\d.]+\), .* tokens/s, ETA", out)
    assert re.search(r"shard 2/2 done: shard-00001.parquet, \d+ rows \(\d+ s, ETA 0 s\)", out)
    for phase in (
        "trajectories/n4",
        "packing/n4",
        "training/n4",
        "trajectories/n8",
        "packing/n8",
        "training/n8",
        "evaluation",
    ):
        assert f"== {phase} done" in out
    report = work / "report"
    for name in ("results.json", "results.md", "tpf_vs_training_tokens.png", "speedup_vs_accuracy.png"):
        assert (report / name).stat().st_size > 0, name
    results = json.loads((report / "results.json").read_text())
    points = list(dict.fromkeys(row["point"] for row in results["curve"]))
    assert points == ["base", "n4@2", "n4@4", "n8@2"]
    pooled = {row["point"]: row for row in results["curve"] if row["benchmark"] == "all" and row["method"] == "jacobi"}
    # Training tokens grow along the curve, and the second stage's count starts where the first one's ends.
    steps = results["training"]
    tokens = [pooled[p]["train_tokens"] for p in points]
    assert tokens[0] == 0 and tokens == sorted(tokens) and len(set(tokens)) == 4
    assert tokens[2] == steps["n4"]["tokens"] and tokens[3] == steps["n4"]["tokens"] + steps["n8"]["tokens"]
    assert [pooled[p]["block_size"] for p in points] == [4, 4, 4, 8]
    # float32 decoding is lossless at every point, and in the final side-by-side evaluation and the check.
    assert all(row["exact"] == 1.0 for row in results["curve"])
    assert results["final"]["exact"]["equal"] == results["final"]["exact"]["checked"] > 0
    # one problem, decoded by the three project methods (jacobi, multiblock, tuned)
    assert results["fp32_check"]["exact"]["equal"] == results["fp32_check"]["exact"]["checked"] == 3
    markdown = (report / "results.md").read_text()
    assert "| n8@2 |" in markdown and "## Final evaluation" in markdown and "outputs identical (every one)" in markdown


def test_the_second_stage_learns_from_the_first_stages_model_on_its_own_trajectories(smoke):
    work, _ = smoke
    first_final, base = work / "n4" / "training" / "final", work / "tiny-model"
    [shard, *_] = sorted((work / "n8" / "trajectories").glob("*/shard-*.parquet"))
    table = pq.read_table(shard, columns=["model_fingerprint", "block_size"]).to_pylist()
    assert {row["block_size"] for row in table} == {8}
    assert {row["model_fingerprint"] for row in table} == {fingerprint(first_final)} != {fingerprint(base)}
    launch = json.loads((work / "n8" / "training" / "launch.json").read_text())
    assert launch["training"]["model"]["name_or_path"] == str(first_final)
    assert json.loads((work / "n8" / "training" / "final" / "jacobi_forcing.json").read_text())["block_size"] == 8
    # The export after 2 steps is a plain checkpoint of its own, between the base and the final weights.
    export = work / "n4" / "training" / "exports" / "step-0000002"
    assert json.loads((export / "jacobi_forcing.json").read_text())["steps"] == 2
    weights = {
        name: AutoModelForCausalLM.from_pretrained(path).state_dict()["lm_head.weight"]
        for name, path in (("base", base), ("export", export), ("final", first_final))
    }
    assert not torch.equal(weights["base"], weights["export"]) and not torch.equal(weights["export"], weights["final"])


def test_a_rerun_resumes_from_what_was_written(smoke):
    work, _ = smoke
    shards = sorted((work / "n4" / "trajectories").glob("*/shard-*.parquet"))
    listed = json.loads((shards[-1].parent / "manifest.json").read_text())["shards"]
    lost, total = len(listed[shards[-1].name]["keys"]), sum(len(s["keys"]) for s in listed.values())
    shards[-1].unlink()  # lost: only its prompts are decoded again
    again = campaign(work, "--phase", "trajectories", "--stage", "n4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{total - lost} already decoded with this model and settings (reused), {lost} to decode" in again.stdout
    rest = campaign(work, "--phase", "training")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert rest.stdout.count("trained already") == 2 and "launching" not in rest.stdout


def test_bad_profiles_fail_with_the_key_named(tmp_path):
    with pytest.raises(ConfigError, match="profile 'nope': no file"):
        load_campaign("nope")
    with pytest.raises(ConfigError, match=r"campaign: unknown key 'curv' \(did you mean 'curve'\?\)"):
        load_campaign("smoke", ["campaign.curv=1"])
    with pytest.raises(ConfigError, match="write key=value"):
        load_campaign("smoke", ["training.max_steps"])
    with pytest.raises(ConfigError, match="curriculum: stage names must differ"):
        load_campaign("smoke", ["curriculum=[{name: a, block_size: 4}, {name: a, block_size: 8}]"])
    failed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.campaign",
            "--profile",
            "smoke",
            "--stage",
            "n64",
            "--set",
            f"work_dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
    )
    assert failed.returncode == 1 and "--stage 'n64': the profile's stages are n4, n8" in failed.stderr


@pytest.mark.parametrize("profile", ["smoke", "cpu-long", "gpu"])
def test_shipped_profiles_load(profile):
    stages = load_campaign(profile).recipe.stages()
    assert [s.trajectories.block_size for s in stages] == {"smoke": [4, 8], "cpu-long": [16], "gpu": [16, 32]}[profile]
    for previous, stage in itertools.pairwise(stages):
        assert stage.model.name_or_path == str(previous.path("training") / "final")


def test_the_flow_runs_the_same_curriculum(tmp_path):
    recipe = load_campaign("smoke", [f"work_dir={tmp_path}", f"model.name_or_path={tmp_path / 'tiny-model'}"]).recipe
    make_tiny_model(tmp_path / "tiny-model")
    result = jacobi_forcing(to_dict(recipe), stages=["trajectories", "packing", "training"])
    assert list(result.stages) == ["n4", "n8"] and result.evaluation is None
    second = result.stages["n8"].trajectories.read()  # the selection file
    shard = Path(second.store) / next(iter(second.shards))
    fingerprints = {row["model_fingerprint"] for row in pq.read_table(shard).to_pylist()}
    first_final = tmp_path / "n4" / "training" / "latest" / "final"
    assert fingerprints == {fingerprint(first_final)}
    assert Path(result.stages["n4"].training.final) == first_final.resolve()
    assert (tmp_path / "n8" / "training" / "latest" / "final" / "config.json").is_file()
    assert (
        result.stages["n8"].packing.stats["sequences"] == second.num_prompts and not result.stages["n8"].training.reused
    )
