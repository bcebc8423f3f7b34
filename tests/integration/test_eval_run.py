"""The evaluation stage end to end: real benchmark files, real local Ray, real MLflow server, real sandbox."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
from mlflow.entities import LoggedModelStatus

from jfcore.chat import encode_chat
from jfcore.config import ConfigError, from_dict
from jfcore.contracts import MODEL_METRICS
from jfcore.decoding.reference import hf_generate
from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.evaluation.config import EvalConfig
from jfcore.evaluation.isolation import IsolationUnavailable, isolation_problem
from jfcore.evaluation.report import REPORT_FILES
from jfcore.models import ModelConfig, ModelLoadError, load_model
from tasks.evaluation import run_evaluation
from tasks.ray_workers import RayConfig
from tasks.tracking import TrackingConfig, client, log_model_by_path, stage_run
from tests.support import REPO
from tests.support.servers import mlflow_server
from tests.support.tiny_models import save_tiny_checkpoint

BENCHMARKS = [{"name": "gsm8k", "limit": 3, "seed": 1}, {"name": "humaneval", "limit": 3, "seed": 1}]
METHODS = ("hf_greedy", "ar", "jacobi", "multiblock")  # the tuned method runs in the pipeline test, after a tune
DECODING = {"max_new_tokens": 24, "block_size": 4, "warmup_tokens": 4, "methods": list(METHODS)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluation")
    base = save_tiny_checkpoint(root / "base", seed=0, initializer_range=0.3)
    trained = save_tiny_checkpoint(root / "trained", seed=1, initializer_range=0.3)
    with mlflow_server(root / "mlflow") as uri:
        # The "trained" checkpoint logged and registered the way the training stage does it.
        tracking = TrackingConfig(uri=uri, experiment="eval-tests", registered_model="jf-eval-tiny")
        run_id = stage_run(tracking, root / "training-stage", "training", {"checkpoint": str(trained)})
        logged = log_model_by_path(tracking, run_id, trained, root / "training-stage")
        yield {
            "root": root,
            "base": base,
            "trained": trained,
            "mlflow": uri,
            "model_uri": "models:/jf-eval-tiny/1",
            "logged": logged,
        }


def eval_config(setup, **changes) -> EvalConfig:
    values = {
        "output_dir": str(setup["root"] / "evaluation"),
        "models": {
            "base": {"model": {"name_or_path": str(setup["base"])}},
            "trained": {"model": {"name_or_path": str(setup["trained"])}, "model_uri": setup["model_uri"]},
        },
        "benchmarks": BENCHMARKS,
        "decoding": DECODING,
        "problems_per_shard": 2,
    }
    return from_dict(EvalConfig, values | changes, "evaluation")


@pytest.fixture(scope="module")
def evaluated(setup):
    lines: list[str] = []
    tracking = TrackingConfig(uri=setup["mlflow"], experiment="eval-tests", run_name="evaluation")
    result = run_evaluation(eval_config(setup), RayConfig(num_workers=2), tracking, log=lines.append)
    samples = pq.read_table(Path(result.report) / "samples.parquet").to_pylist()
    return result, samples, lines


def test_every_model_method_and_problem_is_decoded_scored_and_exact(setup, evaluated):
    result, samples, _ = evaluated
    problems = [p for b in BENCHMARKS for p in load_benchmark(BenchmarkConfig(**b))]
    assert len(samples) == len(problems) * 2 * len(METHODS)
    assert {(s["problem_id"], s["model"], s["method"]) for s in samples} == {
        (p.id, m, k) for p in problems for m in ("base", "trained") for k in METHODS
    }
    # The project's methods are lossless in float32: every output equals its model's greedy output
    # (6 problems x 2 models x 3 methods: ar, jacobi, multiblock).
    assert result.exact == {"equal": 36, "checked": 36}
    assert all(s["exact"] and s["first_divergence"] == len(s["tokens"]) for s in samples)
    assert "36/36 outputs identical (every one)" in result.markdown
    # Each score is what the benchmark's own scoring path says of the stored completion.
    by_id = {p.id: p for p in problems}
    for s in samples[:: len(METHODS)]:
        assert (s["correct"], s["verdict"], s["detail"]) == by_id[s["problem_id"]].score(s["completion"])
    # TPF: greedy decodes one token per forward after the prefill; a parallel method never fewer.
    for s in samples:
        assert s["tpf"] == pytest.approx(s["new_tokens"] / max(s["decode_forwards"], 1))
        if s["method"] == "hf_greedy":
            assert s["decode_forwards"] == s["new_tokens"] - 1
        else:
            assert s["decode_forwards"] <= s["new_tokens"] - 1


def test_stored_greedy_tokens_are_what_generate_returns(setup, evaluated):
    _, samples, _ = evaluated
    model, tokenizer = load_model(ModelConfig(name_or_path=str(setup["trained"])))
    problems = {p.id: p for b in BENCHMARKS for p in load_benchmark(BenchmarkConfig(**b))}
    for s in [s for s in samples if s["model"] == "trained" and s["method"] == "hf_greedy"][:3]:
        prompt = encode_chat(tokenizer, problems[s["problem_id"]].prompt)
        assert s["prompt_tokens"] == len(prompt)
        [expected] = hf_generate(
            model, [prompt], DECODING["max_new_tokens"], [tokenizer.eos_token_id], tokenizer.pad_token_id
        )
        assert s["tokens"] == expected


def test_table_rows_agree_with_the_samples(evaluated):
    result, samples, _ = evaluated
    table = result.table
    assert len(table) == 3 * 2 * len(METHODS)  # gsm8k, humaneval, all x 2 models x 4 methods
    for r in table:
        rows = [
            s
            for s in samples
            if s["model"] == r["model"] and s["method"] == r["method"] and r["benchmark"] in ("all", s["benchmark"])
        ]
        assert r["samples"] == len(rows)
        assert r["accuracy"] == pytest.approx(sum(s["correct"] for s in rows) / len(rows))
        assert r["new_tokens"] == sum(s["new_tokens"] for s in rows)
    base_greedy = {r["benchmark"]: r["tps"] for r in table if r["model"] == "base" and r["method"] == "hf_greedy"}
    own_ar = {(r["benchmark"], r["model"]): r["tps"] for r in table if r["method"] == "ar"}
    for r in table:
        assert r["speedup"] == pytest.approx(r["tps"] / base_greedy[r["benchmark"]])
        assert r["speedup_vs_ar"] == pytest.approx(r["tps"] / own_ar[r["benchmark"], r["model"]])


def test_mlflow_holds_table_plots_metrics_and_the_model_link(setup, evaluated):
    result, _, _ = evaluated
    mlflow = client(TrackingConfig(uri=setup["mlflow"]))
    run = mlflow.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["jacobi_forcing.stage"] == "evaluation"
    assert run.data.tags["mlflow.note.content"] == result.markdown
    assert run.data.params["evaluation.decoding.block_size"] == "4"
    row = next(r for r in result.table if (r["benchmark"], r["model"], r["method"]) == ("gsm8k", "trained", "jacobi"))
    assert run.data.metrics["gsm8k/trained/jacobi/tpf"] == pytest.approx(row["tpf"])
    assert run.data.metrics["all/base/multiblock/exact"] == 1.0
    artifacts = {
        f.path for folder in ("evaluation", "evaluation/plots") for f in mlflow.list_artifacts(run.info.run_id, folder)
    }
    assert {f"evaluation/{name}" for name in REPORT_FILES} <= artifacts
    # Every evaluated checkpoint has a LoggedModel (the registered one for "trained", one made for the base model),
    # with its params and, per benchmark dataset, its headline method's figures (multiblock here: no tune ran). The
    # run lists both models and each benchmark (file, digest, rows) as its inputs.
    model_id = setup["logged"]["model_uri"].removeprefix("models:/")
    assert result.model_ids["trained"] == model_id and result.model_ids["base"] != model_id
    assert {m.model_id for m in run.inputs.model_inputs} == set(result.model_ids.values())
    inputs = {d.dataset.name: d.dataset for d in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["all", "gsm8k", "humaneval"]
    assert json.loads(inputs["gsm8k"].source)["uri"].endswith("eval/gsm8k_test.jsonl")
    assert json.loads(inputs["humaneval"].profile) == {"num_rows": 3}
    assert run.data.tags["jacobi_forcing.headline_method"] == "multiblock"
    for label, logged_id in result.model_ids.items():
        logged = mlflow.get_logged_model(logged_id)
        linked = {(m.key, m.dataset_name, m.dataset_digest): m.value for m in logged.metrics}
        rows = {r["benchmark"]: r for r in result.table if r["model"] == label and r["method"] == "multiblock"}
        assert linked == {
            (f"{b}/{name}", b, inputs[b].digest): pytest.approx(rows[b][column])
            for b in rows
            for name, column in MODEL_METRICS.items()
        }
        assert logged.params["source"] == str(setup[label]) and logged.params["training_steps"] == "0"
    base = mlflow.get_logged_model(result.model_ids["base"])
    assert base.name == "base base" and base.source_run_id == run.info.run_id and base.status == LoggedModelStatus.READY


def test_a_rerun_reuses_every_shard_and_a_lost_one_is_redone(setup, evaluated):
    result, samples, _ = evaluated
    folder = Path(result.folder)
    lines: list[str] = []
    again = run_evaluation(eval_config(setup), RayConfig(num_workers=1), log=lines.append)
    assert again.folder == result.folder
    assert any("3/3 shards already complete, 0 to make" in line for line in lines)
    (folder / "shard-00001.parquet").unlink()
    lines.clear()
    redone = run_evaluation(eval_config(setup), RayConfig(num_workers=1), log=lines.append)
    assert any("2/3 shards already complete, 1 to make" in line for line in lines)
    resampled = pq.read_table(Path(redone.report) / "samples.parquet").to_pylist()
    assert [s["tokens"] for s in resampled] == [s["tokens"] for s in samples]
    # Changed settings name another folder: old samples are never reused for them.
    other = eval_config(setup, decoding=DECODING | {"block_size": 8})
    assert run_evaluation(other, RayConfig(num_workers=1), log=lines.append).folder != result.folder


def test_bad_inputs_fail_before_ray_starts(setup, tmp_path):
    assert not ray.is_initialized()
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(setup["trained"], no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    models = {"base": {"model": {"name_or_path": str(no_tokenizer)}}}
    with pytest.raises(ModelLoadError, match=r"has no tokenizer .*tokenizer\.save_pretrained"):
        run_evaluation(eval_config(setup, models=models))
    with pytest.raises(FileNotFoundError, match="gsm8k: no file at /nowhere/gsm8k.jsonl"):
        run_evaluation(eval_config(setup, benchmarks=[{"name": "gsm8k", "path": "/nowhere/gsm8k.jsonl"}]))
    with pytest.raises(ModelLoadError, match="does not exist"):
        run_evaluation(eval_config(setup, models={"base": {"model": {"name_or_path": str(tmp_path / "gone")}}}))
    with pytest.raises(ConfigError, match="unknown benchmark|is not one of"):
        eval_config(setup, benchmarks=[{"name": "humaneval+"}])
    assert not ray.is_initialized()


def test_code_evaluation_refuses_to_run_unisolated_unless_told_it_is_unsafe(setup, evaluated, tmp_path, monkeypatch):
    assert evaluated[0].code_isolation == "bubblewrap namespaces, unprivileged uid"
    monkeypatch.setenv("PATH", "/nonexistent")  # a host without bubblewrap
    isolation_problem.cache_clear()
    try:
        with pytest.raises(IsolationUnavailable, match="bubblewrap .* is not installed.*unsafe_no_isolation: true"):
            run_evaluation(eval_config(setup, output_dir=str(tmp_path)))
        assert not ray.is_initialized()
        lines: list[str] = []
        config = eval_config(setup, output_dir=str(tmp_path), unsafe_no_isolation=True)
        result = run_evaluation(config, RayConfig(address="none"), log=lines.append)
    finally:
        isolation_problem.cache_clear()
    assert any(line.startswith("WARNING: unsafe_no_isolation is set") for line in lines)
    manifest = json.loads((Path(result.folder) / "manifest.json").read_text())
    assert result.code_isolation == manifest["code_isolation"] == "unsafe: none (unsafe_no_isolation)"
    assert Path(result.folder).parent == tmp_path  # its own run folder: never mixed with isolated verdicts


def test_cli_reports_a_bad_recipe_in_one_line(tmp_path):
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(
        "evaluation:\n  output_dir: out\n  models: {base: {model: {name_or_path: m}}}\n"
        "  benchmarks: [{name: gsm8k}]\n  decoding: {block_sise: 8}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "cli.evaluate", "--config", str(recipe)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "error: evaluation.decoding: unknown key 'block_sise' (did you mean 'block_size'?); valid keys: block_size, "
        "max_new_tokens, methods, ngram_size, num_blocks, pool_size, prompt_lookup_tokens, rolling, spawn_ratio, "
        "timed_methods, timing_rounds, warmup_tokens"
    )
