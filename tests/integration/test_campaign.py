"""The smoke campaign: a recipe the flow runs with no servers (Prefect's temporary local server, no MLflow, no
Ray) or without Prefect, Ray and MLflow installed, stage by stage as well as whole, and the campaign report read
from the files it wrote."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.tiny_model import make_tiny_model
from flows.recipe import load_recipe
from jfcore.hostspeed import scaled
from jfcore.models import ModelConfig, load_model, model_fingerprint
from tests.support import REPO

SMOKE = "configs/campaign/smoke.yaml"


def without_orchestration(folder: Path) -> Path:
    """This environment's packages minus Prefect, Ray and MLflow: a machine where they are not installed."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    folder.mkdir(exist_ok=True)
    for entry in site.iterdir():
        if not re.match(r"(prefect|ray|mlflow)([-_.]|$)", entry.name.lower()) and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry)
    return folder


def command(
    module: str, work: Path, *args: str, recipe: str = SMOKE, bare: bool = False
) -> subprocess.CompletedProcess:
    """`python -m module recipe` on the smoke recipe in `work`; `bare`: where Prefect, Ray and MLflow are missing."""
    sets = ["--set", f"work_dir={work}", "--set", f"model.name_or_path={work / 'tiny-model'}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_"))}
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # the stages' progress lines
    python = [sys.executable]
    if bare:  # -S: no site-packages but those on PYTHONPATH (the training processes see the full environment)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(without_orchestration(work.parent / "site-packages"))])
        python.append("-S")
    return subprocess.run(
        [*python, "-m", module, recipe, *sets, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(900),
        check=False,
    )


def flow(work: Path, *args: str, bare: bool = False) -> subprocess.CompletedProcess:
    return command("flows.run", work, *args, bare=bare)


def timings(work: Path) -> list[str]:
    return [json.loads(line)["stage"] for line in (work / "timings.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    work = tmp_path_factory.mktemp("campaign") / "work"
    make_tiny_model(work / "tiny-model")
    first = flow(work)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    report = command("bench.campaign_report", work)
    assert report.returncode == 0, report.stderr[-4000:]
    return work, first.stdout + first.stderr


def fingerprint(path: Path) -> str:
    return model_fingerprint(load_model(ModelConfig(name_or_path=str(path)))[0])


def test_every_stage_runs_without_servers_and_the_report_reads_what_they_wrote(smoke):
    work, out = smoke
    assert "Starting temporary server" in out  # Prefect's own, for this run only: no server was started beforehand
    assert "Started a local Ray" not in out  # the recipe runs each stage's worker in this process
    assert not list(work.rglob("mlflow_run.json"))  # no tracking: nothing was logged anywhere
    assert re.search(
        r"step 4/4: loss [\d.]+ \(ar [\d.]+, consistency [\d.]+, copy [\d.]+, repeat [\d.]+\), .* tokens/s, ETA", out
    )
    assert re.search(r"shard 2/2 done: shard-00001.parquet, \d+ rows \(\d+ s, ETA 0 s\)", out)
    stages = ["trajectories", "packing", "training"]
    assert timings(work) == [f"{s}/{c}" for c in ("n4", "n8") for s in stages] + [
        "tuning",
        "evaluation",
        "curve",
        "fp32-check",
    ]
    # Each stage's record names the folder it wrote, so the report counts only the seconds of what it reports.
    outputs = {r["stage"]: r.get("output") for r in map(json.loads, (work / "timings.jsonl").read_text().splitlines())}
    assert outputs["training/n8"] == str((work / "n8" / "training" / "latest").resolve())
    assert outputs["packing/n4"] == str(next((work / "n4" / "packing").iterdir()).resolve())
    assert Path(outputs["trajectories/n4"], "manifest.json").is_file()
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
    assert results["phases"]["trajectories/n4"]["tokens_per_second"] > 0
    # float32 decoding is lossless at every point, and in the side-by-side evaluation and the check.
    assert all(row["exact"] == 1.0 for row in results["curve"])
    assert results["final"]["exact"]["equal"] == results["final"]["exact"]["checked"] > 0
    # one problem, decoded by the four project methods (ar, jacobi, multiblock, tuned)
    assert results["fp32_check"]["exact"]["equal"] == results["fp32_check"]["exact"]["checked"] == 4
    markdown = (report / "results.md").read_text()
    assert "| n8@2 |" in markdown and "## Final evaluation" in markdown and "outputs identical (every one)" in markdown
    assert f"python -m flows.run {SMOKE} --set work_dir={work}" in markdown


def test_the_second_stage_learns_from_the_first_stages_model_on_its_own_trajectories(smoke):
    work, _ = smoke
    first_final, base = (work / "n4" / "training" / "latest" / "final").resolve(), work / "tiny-model"
    [shard, *_] = sorted((work / "n8" / "trajectories").glob("*/shard-*.parquet"))
    table = pq.read_table(shard, columns=["model_fingerprint", "block_size"]).to_pylist()
    assert {row["block_size"] for row in table} == {8}
    assert {row["model_fingerprint"] for row in table} == {fingerprint(first_final)} != {fingerprint(base)}
    launch = json.loads((work / "n8" / "training" / "latest" / "launch.json").read_text())
    assert launch["training"]["model"]["name_or_path"] == str(first_final)
    final = work / "n8" / "training" / "latest" / "final"
    assert json.loads((final / "jacobi_forcing.json").read_text())["block_size"] == 8
    # The export after 2 steps is a plain checkpoint of its own, between the base and the final weights.
    export = work / "n4" / "training" / "latest" / "exports" / "step-0000002"
    assert json.loads((export / "jacobi_forcing.json").read_text())["steps"] == 2
    weights = {
        name: AutoModelForCausalLM.from_pretrained(path).state_dict()["lm_head.weight"]
        for name, path in (("base", base), ("export", export), ("final", first_final))
    }
    assert not torch.equal(weights["base"], weights["export"]) and not torch.equal(weights["export"], weights["final"])


def test_one_stage_at_a_time_resumes_from_what_was_written_even_without_prefect(smoke):
    work, _ = smoke
    before = len(timings(work))
    shards = sorted((work / "n4" / "trajectories").glob("*/shard-*.parquet"))
    listed = json.loads((shards[-1].parent / "manifest.json").read_text())["shards"]
    lost, total = len(listed[shards[-1].name]["keys"]), sum(len(s["keys"]) for s in listed.values())
    shards[-1].unlink()  # lost: only its prompts are decoded again
    again = flow(work, "--stages", "trajectories", "--curriculum", "n4", bare=True)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert "Starting temporary server" not in out  # no Prefect at all: the flow ran as plain Python calls
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import prefect"],
        env={"PYTHONPATH": str(work.parent / "site-packages")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert "No module named 'prefect'" in probe.stderr
    assert f"{total - lost} already decoded with this model and settings (reused), {lost} to decode" in out
    assert timings(work)[before:] == ["trajectories/n4"]  # nothing after it ran, nor the next curriculum stage
    rest = flow(work, "--stages", "packing", "training")
    assert rest.returncode == 0, rest.stderr[-3000:]
    out = rest.stdout + rest.stderr
    assert out.count("training: reused") == 2 and "launching" not in out and "is new; packing" not in out
    assert timings(work)[before + 1 :] == ["packing/n4", "training/n4", "packing/n8", "training/n8"]


def test_an_anchored_stage_iterates_on_an_earlier_stages_text(smoke):
    """A third stage anchored to the first: the second stage's model iterates on the first stage's text, whose
    blocks are its fixed points, and trains on it."""
    work, _ = smoke
    stages = (
        "curriculum=[{name: n4, block_size: 4, window: 4, training: {max_steps: 4, export_steps: [2]}},"
        " {name: n8, block_size: 8, window: 8, prompts_limit: 4, training: {max_steps: 2}},"
        " {name: anchored, block_size: 8, window: 8, prompts_limit: 4, anchor: n4, training: {max_steps: 1}}]"
    )
    run = flow(work, "--set", stages, "--stages", "trajectories", "packing", "training")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "anchored: fixed points from" in run.stdout + run.stderr

    def texts(stage: str) -> dict[str, list[int]]:
        [store] = (work / stage / "trajectories").iterdir()
        rows = sorted(
            (r for shard in store.glob("shard-*.parquet") for r in pq.read_table(shard).to_pylist()),
            key=lambda r: (r["prompt_id"], r["block_index"]),
        )
        out: dict[str, list[int]] = {}
        for row in rows:
            out.setdefault(row["prompt_id"], []).extend(row["fixed_point"])
        return out

    anchored, first, second = texts("anchored"), texts("n4"), texts("n8")
    assert len(anchored) == 4 and anchored == {pid: first[pid] for pid in anchored}
    assert anchored != second  # the second stage's model writes text of its own
    [shard, *_] = sorted((work / "anchored" / "trajectories").glob("*/shard-*.parquet"))
    prints = {row["model_fingerprint"] for row in pq.read_table(shard, columns=["model_fingerprint"]).to_pylist()}
    assert prints == {fingerprint((work / "n8" / "training" / "latest" / "final").resolve())}
    assert (work / "anchored" / "training" / "latest" / "final" / "jacobi_forcing.json").is_file()


def test_bad_input_fails_with_what_to_fix(tmp_path, monkeypatch):
    from bench.campaign_report import main as report
    from flows.run import main as run

    monkeypatch.chdir(REPO)
    make_tiny_model(tmp_path / "tiny-model")
    sets = ["--set", f"work_dir={tmp_path}", "--set", f"model.name_or_path={tmp_path / 'tiny-model'}"]
    cases = [
        (["--curriculum", "n64"], "curriculum: unknown stage 'n64'; the recipe's stages are n4, n8"),
        (["--set", "evaluation.learning_curv=1"], "unknown key 'learning_curv' (did you mean 'learning_curve'?)"),
        (["--stages", "train"], "'train' is now 'training'"),
        (["--set", "training.max_steps"], "write key=value"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as failed:
            run([SMOKE, *sets, *args])
        assert str(failed.value.code).startswith("error: ") and message in str(failed.value.code), args
    assert not (tmp_path / "timings.jsonl").exists()  # nothing ran
    with pytest.raises(SystemExit) as failed:
        report(["configs/campaign/nope.yaml"])
    assert "config file not found: configs/campaign/nope.yaml" in str(failed.value.code)


@pytest.mark.parametrize("profile", ["smoke", "cpu-long", "gpu"])
def test_shipped_profiles_load(profile):
    recipe = load_recipe(REPO / "configs" / "campaign" / f"{profile}.yaml")
    stages = recipe.stages()
    assert [s.trajectories.block_size for s in stages] == {"smoke": [4, 8], "cpu-long": [16], "gpu": [16, 32]}[profile]
    assert recipe.evaluation.learning_curve is not None
    for previous, stage in itertools.pairwise(stages):
        assert stage.model.name_or_path == str(previous.path("training") / "latest" / "final")


def test_the_2_hour_recipe_is_the_measured_ablation_variant():
    """configs/campaign/cpu-2h.yaml is what `bench.ablation --variants recipe-repeat-penalty` trains: the same
    trajectories, packing and training settings, so the flow reuses that run instead of training another."""
    from bench.ablation import VARIANTS
    from jfcore.config import apply_overrides, load_file

    recipe = load_recipe(REPO / "configs" / "campaign" / "cpu-2h.yaml")
    variant = load_recipe(
        apply_overrides(
            load_file(REPO / "configs" / "campaign" / "cpu-ablation.yaml"), VARIANTS["recipe-repeat-penalty"][0]
        )
    )
    for section in ("work_dir", "model", "prompts", "trajectories", "packing", "training", "launch"):
        assert getattr(recipe, section) == getattr(variant, section), section
    assert recipe.evaluation.base_vs_trained and "tuned" in recipe.evaluation.decoding.methods


def test_the_on_policy_recipe_reuses_the_2_hour_run_then_learns_from_its_model_twice_then_on_code():
    """configs/campaign/cpu-2h-onpolicy.yaml's first round is cpu-2h.yaml's run in the same folder (so the flow
    reuses it); each later round decodes its trajectories with the round before's model, at the same block size,
    and packs its answers only up to the loops they end in. The last round decodes MBPP's training prompts."""
    two_hours = load_recipe(REPO / "configs" / "campaign" / "cpu-2h.yaml").stages()[0]
    first, *rounds, code = load_recipe(REPO / "configs" / "campaign" / "cpu-2h-onpolicy.yaml").stages()
    for part in ("folder", "model", "prompts", "trajectories", "packing", "training"):
        assert getattr(first, part) == getattr(two_hours, part), part
    assert len(rounds) == 2 and not first.packing.cut_loops
    for before, stage in zip([first, *rounds], [*rounds, code]):
        assert stage.model.name_or_path == str(before.path("training") / "latest" / "final")
        assert stage.trajectories == first.trajectories
        assert stage.packing.cut_loops and stage.packing.window == first.packing.window
        assert stage.training.ar_weight == first.training.ar_weight
    for stage in rounds:
        assert stage.prompts == first.prompts and stage.training.max_steps == 400
    assert Path(code.prompts.path).name == "mbpp_train.jsonl" and code.prompts.limit == first.prompts.limit
    assert code.training.max_steps == 150


def test_the_fresh_prompt_recipe_trains_each_on_policy_round_on_prompts_no_round_trained_on():
    """configs/campaign/cpu-2h-fresh.yaml reuses cpu-2h.yaml's run, then each round decodes its trajectories with the
    round before's model on another draw of the same pool: the rounds' prompt sets, read from the pool itself,
    share at most a sixteenth of their prompts with any earlier round's."""
    from jfcore.prompts import load_prompt_texts

    two_hours = load_recipe(REPO / "configs" / "campaign" / "cpu-2h.yaml").stages()[0]
    first, *rounds = load_recipe(REPO / "configs" / "campaign" / "cpu-2h-fresh.yaml").stages()
    for part in ("folder", "model", "prompts", "trajectories", "packing", "training"):
        assert getattr(first, part) == getattr(two_hours, part), part
    assert len(rounds) == 2

    def drawn(stage) -> set[str]:
        return {key for key, _ in load_prompt_texts(replace(stage.prompts, path=str(REPO / stage.prompts.path)))}

    seen = drawn(first)
    for before, stage in zip([first, *rounds], rounds):
        assert stage.model.name_or_path == str(before.path("training") / "latest" / "final")
        assert stage.trajectories == first.trajectories and stage.training.max_steps == 400
        assert stage.packing.cut_loops and stage.packing.window == first.packing.window
        assert stage.training.ar_weight == first.training.ar_weight
        assert stage.prompts.path == first.prompts.path and stage.prompts.limit == first.prompts.limit
        prompts = drawn(stage)
        assert len(prompts) == stage.prompts.limit and len(prompts & seen) <= stage.prompts.limit // 16, stage.name
        seen |= prompts
