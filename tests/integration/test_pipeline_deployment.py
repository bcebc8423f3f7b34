"""`prefect deployment run jacobi-forcing/full` on the local stack (real Prefect server and process worker,
real MLflow server), with a tiny model: real Ray trajectories, Parquet, DeepSpeed training, evaluation and
the tuning stage and the registry. The first flow run is cancelled during training; the second reuses the data
stages' outputs and resumes training from its checkpoint."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from jfcore.contracts import MODEL_METRICS
from jfcore.hostspeed import scaled
from tests.support.flow_stack import (
    REPO,
    TINY_TUNE,
    prefect,
    start_run,
    start_stack,
    state_of,
    stop_stack,
    wait_for,
)
from tests.support.tiny_models import save_tiny_checkpoint

STEPS = 600  # 9 sequences, 2 processes x micro batch 2: 2 steps an epoch; long enough to be cancelled midway


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("pipeline"))
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def recipe(stack) -> Path:
    root = stack["root"]
    model = save_tiny_checkpoint(root / "base", initializer_range=0.3)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": " ".join(f"w{(7 * i + j) % 120 + 3}" for j in range(3 + i % 5))}) + "\n"
            for i in range(12)
        )
    )
    path = root / "recipe.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "work_dir": str(root / "work"),
                "model": {"name_or_path": str(model)},
                "prompts": {"path": str(prompts), "chat_template": False},
                "trajectories": {"block_size": 4, "max_new_tokens": 12, "batch_size": 4},
                "prompts_per_shard": 4,
                "ray": {"num_workers": 2},
                "packing": {"heldout_fraction": 0.2},  # prompts 2, 3 and 9 (the hash of their ids)
                "training": {
                    "max_steps": STEPS,
                    "epochs": 200,
                    "micro_batch_size": 2,
                    "learning_rate": 2.0e-3,
                    "checkpoint_every": 25,
                    "acceptance": {"every": 100, "block_sizes": [4]},
                },
                "launch": {"processes": 2, "threads_per_process": 1},
                "tuning": TINY_TUNE,
                "evaluation": {
                    "benchmarks": [{"name": "gsm8k", "limit": 2, "seed": 0}, {"name": "humaneval", "limit": 1}],
                    "decoding": {"max_new_tokens": 16, "block_size": 4, "warmup_tokens": 2},
                },
                "tracking": {"uri": stack["mlflow"], "registered_model": "jf-pipeline-tiny"},
            }
        )
    )
    return path


def task_states(stack, flow_run_id: str) -> dict[str, str]:
    """Task name (without its run suffix) -> final state name, from the Prefect API."""
    from uuid import UUID

    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with SyncPrefectClient(api=stack["env"]["PREFECT_API_URL"]) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)])))
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


@pytest.fixture(scope="module")
def two_runs(stack, recipe):
    train = stack["root"] / "work" / "training"
    first = start_run(stack, recipe)
    wait_for(lambda: any(train.glob("*/checkpoints/step-*/jf_complete.json")), 600, "a complete training checkpoint")
    prefect(stack, "flow-run", "cancel", first)
    wait_for(lambda: state_of(stack, first) in ("CANCELLED", "FAILED", "CRASHED"), 120, "the cancelled flow run")
    wait_for(lambda: not _training_processes(stack["root"]), 60, "the training processes to go")
    kept = sorted(p.parent.name for p in train.glob("*/checkpoints/step-*/jf_complete.json"))
    second = start_run(stack, recipe)
    prefect(stack, "flow-run", "watch", second, timeout=900)
    return {"first": first, "second": second, "kept": kept, "logs": prefect(stack, "flow-run", "logs", second)}


def _training_processes(root: Path) -> list[str]:
    """This test's training processes (their launch file is under `root`; other training may run beside it)."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if "tasks.train_worker" in line and str(root) in line]


def test_cancelled_run_resumes_from_cache_and_checkpoint(stack, two_runs):
    assert state_of(stack, two_runs["first"]) == "CANCELLED"
    assert state_of(stack, two_runs["second"]) == "COMPLETED"
    logs = two_runs["logs"]
    states = task_states(stack, two_runs["second"])
    assert "12 already decoded with this model and settings (reused), 0 to decode" in logs
    assert "packing: reused" in logs and "training: reused" not in logs  # training resumed, it was unfinished
    stages = ("trajectories", "packing", "training", "tuning-trained", "tuning-base", "evaluation", "registry")
    assert [states[s] for s in stages] == ["Completed"] * 7
    step = int(two_runs["kept"][-1].removeprefix("step-"))
    assert f"resumed from step {step} " in logs  # the training loop's own line, after loading the checkpoint
    assert step < STEPS  # it was cancelled before the end


def test_progress_is_logged_with_an_eta_and_shown_as_artifacts(stack, two_runs):
    from uuid import UUID

    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    steps = [int(m[1]) for m in re.finditer(r"step (\d+)/600: loss [0-9.]+ .*ETA [0-9.]+ min", two_runs["logs"])]
    assert steps and steps[-1] == STEPS and steps == sorted(steps)
    with SyncPrefectClient(api=stack["env"]["PREFECT_API_URL"]) as client:
        runs = [UUID(two_runs["first"]), UUID(two_runs["second"])]
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=runs))
        )
    progress = {(str(a.flow_run_id), a.key): a.data for a in artifacts if a.type == "progress"}
    assert progress[(two_runs["second"], "training-progress")] == 100.0
    # The training artifact carries the held-out acceptance the training stage measured last.
    described = {(str(a.flow_run_id), a.key): a.description for a in artifacts if a.type == "progress"}
    assert re.search(r"simulated TPF n4 [\d.]+, noisy accuracy", described[(two_runs["second"], "training-progress")])
    assert progress[(two_runs["second"], "evaluation-progress")] == 100.0
    assert 0 < progress[(two_runs["first"], "training-progress")] < 100.0  # where the cancelled run stopped
    assert progress[(two_runs["first"], "trajectories-progress")] == 100.0
    assert (two_runs["second"], "trajectories-progress") not in progress  # nothing was left to decode


def test_parquet_outputs(stack, two_runs):
    work = stack["root"] / "work"
    [store] = [p.parent for p in (work / "trajectories").glob("*/manifest.json")]
    manifest = json.loads((store / "manifest.json").read_text())
    [selection] = [json.loads(p.read_text()) for p in (store / "sets").glob("*.json")]
    assert selection["num_prompts"] == 12 and len(manifest["shards"]) == 3 == len(selection["shards"])
    rows = [r for f in sorted(store.glob("shard-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len({r["prompt_id"] for r in rows}) == 12
    [packed] = list((work / "packing").iterdir())
    stats = json.loads((packed / "stats.json").read_text())
    assert stats["sequences"] == 9 == sum(pq.read_table(f).num_rows for f in packed.glob("packed-*.parquet"))
    # The held-out prompts (heldout_fraction 0.2: 3 of 12, by the hash of their ids) are packed apart, not trained.
    heldout = json.loads((packed / "heldout" / "stats.json").read_text())
    assert heldout["sequences"] == 3 == sum(pq.read_table(f).num_rows for f in (packed / "heldout").glob("*.parquet"))
    assert len(set(stats["heldout_prompts"])) == 3 and set(stats["heldout_prompts"]) <= {r["prompt_id"] for r in rows}
    [report] = list((work / "evaluation").glob("*/report"))
    samples = pq.read_table(report / "samples.parquet").to_pylist()
    assert len(samples) == 3 * 2 * 5 and all(s["exact"] for s in samples)  # problems x models x methods
    assert (work / "training" / "latest" / "final" / "config.json").is_file()
    # The tuning stage wrote the trained model's tune for this machine, which evaluation's "tuned" method ran.
    from jfcore.jacobi_forcing_json import tuned_decoding
    from jfcore.machine import this_machine

    # The base model, the gate's bar, was tuned too, into its own checkpoint.
    for checkpoint in (work / "training" / "latest" / "final", stack["root"] / "base"):
        tuned = tuned_decoding(checkpoint)
        assert not tuned.machine.differences(replace(this_machine("cpu", "float32"), torch_threads=1))
        assert Path(tuned.report).parent == work / "tuning" and (Path(tuned.report) / "tune.json").is_file()
    # The gate's method was timed in 3 interleaved rounds, the others once.
    assert {(s["method"], len(s["round_seconds"])) for s in samples} == {
        ("hf_greedy", 1),
        ("ar", 1),
        ("jacobi", 1),
        ("multiblock", 1),
        ("tuned", 3),
    }


def test_mlflow_parent_and_stage_runs_model_and_aliases(stack, two_runs):
    from mlflow import MlflowClient

    mlflow = MlflowClient(stack["mlflow"])
    experiment = mlflow.get_experiment_by_name("jacobi-forcing")
    runs = mlflow.search_runs([experiment.experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("jacobi_forcing.flow_run_id") == two_runs["second"]]
    assert (
        parent.info.status == "FINISHED" and "| gsm8k | trained | jacobi |" in parent.data.tags["mlflow.note.content"]
    )
    assert parent.data.params["recipe.trajectories.block_size"] == "4"
    nested = {
        r.data.tags["jacobi_forcing.stage"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert {"trajectories", "packing", "tuning", "evaluation"} <= set(nested)
    assert nested["tuning"].data.metrics["batch1/speedup_measured"] > 0
    assert {a.path for a in mlflow.list_artifacts(nested["tuning"].info.run_id, "tuning")} >= {"tuning/tune.json"}
    assert all(run.info.run_name == stage for stage, run in nested.items())  # the UI lists them by stage
    assert nested["packing"].data.metrics["sequences"] == 9  # 3 of the 12 prompts are held out
    [selection] = mlflow.list_artifacts(nested["trajectories"].info.run_id, "trajectories")
    assert re.fullmatch(r"trajectories/[0-9a-f]{16}\.json", selection.path)  # the prompt set's selection file
    assert nested["trajectories"].data.metrics["reused_prompts"] == 12
    # Training began under the cancelled flow run's parent and resumed into the same run.
    [train] = [r for r in runs if r.data.tags.get("jacobi_forcing.stage") == "training"]
    assert train.info.status == "FINISHED" and train.data.metrics["loss"] > 0
    assert {m.step for m in mlflow.get_metric_history(train.info.run_id, "loss")} == set(range(1, STEPS + 1))
    # The new version is the challenger; the log says whether it passed the gate, and the aliases agree.
    aliases = mlflow.get_registered_model("jf-pipeline-tiny").aliases
    promoted = "gate: v1 promoted to champion" in two_runs["logs"]
    assert promoted or "gate: v1 stays challenger" in two_runs["logs"]
    assert aliases == ({"challenger": "1", "champion": "1"} if promoted else {"challenger": "1"})
    version = mlflow.get_model_version("jf-pipeline-tiny", "1")
    assert version.tags["jacobi_forcing.eval.method"] == "tuned"
    # The registered model carries its tune: a registry download decodes with it on this machine.
    import mlflow as mlflow_module

    mlflow_module.set_tracking_uri(stack["mlflow"])
    fetched = Path(
        mlflow_module.artifacts.download_artifacts(
            "models:/jf-pipeline-tiny/1", dst_path=str(stack["root"] / "fetched")
        )
    )
    [record] = list(fetched.rglob("jacobi_forcing.json"))
    assert "tuned" in json.loads(record.read_text())
    assert version.tags["jacobi_forcing.gate.decision"] == ("promoted" if promoted else "rejected")
    reason = version.tags["jacobi_forcing.gate.reason"]
    assert "tuned vs the base model's tuned: " in reason and "median of 3 interleaved rounds, spread " in reason


def test_scheduled_deployment_has_its_cron_and_concurrency_limit(stack, two_runs):
    deployment = json.loads(prefect(stack, "deployment", "inspect", "jacobi-forcing/retrain", "--output", "json"))
    [schedule] = deployment["schedules"]
    assert schedule["schedule"]["cron"] == "0 3 * * 0" and schedule["schedule"]["timezone"] == "UTC"
    assert schedule["active"]
    assert deployment["global_concurrency_limit"]["limit"] == 1
    assert deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    names = {
        json.loads(prefect(stack, "deployment", "inspect", f"jacobi-forcing/{n}", "--output", "json"))["name"]
        for n in ("full", "evaluation")
    }
    assert names == {"full", "evaluation"}


def test_results_table_is_a_prefect_artifact(stack, two_runs):
    out = subprocess.run(
        [sys.executable, "infra/stack.py", "results"],
        env=stack["env"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=scaled(120),
    ).stdout
    assert "| gsm8k | trained | tuned |" in out and "outputs identical (every one)" in out
    assert "| gsm8k | base | tuned |" in out  # the gate's bar, tuned by the pipeline too
    assert re.search(
        r"\*\*gate\*\*: v1 (promoted to champion|stays challenger): .*tuned vs the base model's tuned", out
    )
    assert f"MLflow UI: {stack['mlflow']}" in out
    assert f"Compare checkpoints (MLflow Models tab): {stack['mlflow']}/#/experiments/" in out


def _checkpoints(stack) -> tuple[object, dict[str, object]]:
    """The experiment and its LoggedModels by name."""
    from mlflow import MlflowClient

    mlflow = MlflowClient(stack["mlflow"])
    experiment = mlflow.get_experiment_by_name("jacobi-forcing")
    return experiment, {m.name: m for m in mlflow.search_logged_models([experiment.experiment_id])}


def test_checkpoints_compare_in_mlflow_with_their_params_metrics_and_datasets(stack, two_runs):
    """Without a browser: a training experiment; the base and the trained checkpoint each a LoggedModel with its
    params and its pooled and per-benchmark figures under the tuned decoding (equal to the evaluation run's
    cells); the parent run readable, with headline metrics and tags; every stage run lists what it read."""
    from mlflow import MlflowClient

    mlflow = MlflowClient(stack["mlflow"])
    experiment, models = _checkpoints(stack)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = mlflow.search_runs([experiment.experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("jacobi_forcing.flow_run_id") == two_runs["second"]]
    nested = {r.data.tags["jacobi_forcing.stage"]: r for r in runs if r.data.tags.get("jacobi_forcing.stage")}
    evaluation = nested["evaluation"]
    assert evaluation.data.tags["jacobi_forcing.headline_method"] == "tuned"
    [trained_name] = [n for n in models if n.startswith("trained ")]
    assert set(models) == {"base base", trained_name}
    [train] = [r for r in runs if r.data.tags.get("jacobi_forcing.stage") == "training"]
    final_step = {  # the training run's figures at its last step: its loss and its held-out acceptance
        m.key: (m.value, None)
        for key in train.data.metrics
        for m in mlflow.get_metric_history(train.info.run_id, key)
        if m.step == STEPS
    }
    assert {"loss", "heldout/simulated_tpf_n4", "heldout/decoded_tpf_n4"} <= set(final_step)
    for label, name in (("base", "base base"), ("trained", trained_name)):
        logged = {m.key: (m.value, m.dataset_name) for m in models[name].metrics}
        expected = {
            f"{b}/{metric}": (evaluation.data.metrics[f"{b}/{label}/tuned/{column}"], b)
            for b in ("gsm8k", "humaneval", "all")
            for metric, column in MODEL_METRICS.items()
        }
        assert logged == expected | (final_step if label == "trained" else {})
        assert {"source", "trained_block_size", "training_steps", "training_folder", "tuned_decoding"} <= set(
            models[name].params
        )
    trained = models[trained_name].params
    assert trained["trained_block_size"] == "4" and trained["training_steps"] == str(STEPS)
    assert trained["tuned_decoding"].startswith("batch 1: ")
    assert trained["recipe_digest"] == parent.data.tags["jacobi_forcing.recipe_digest"]
    assert models["base base"].params["training_steps"] == "0"
    # The parent run: a readable name, the headline figures of both models, the recipe and the registered version.
    assert parent.info.run_name == f"base: full pipeline ({prefect_flow_run_name(stack, two_runs['second'])})"
    assert parent.data.metrics["trained/speedup"] == evaluation.data.metrics["all/trained/tuned/speedup"]
    assert parent.data.metrics["base/accuracy"] == evaluation.data.metrics["all/base/tuned/accuracy"]
    assert parent.data.tags["jacobi_forcing.recipe"].endswith("recipe.yaml")
    assert parent.data.tags["jacobi_forcing.registered_version"] == "jf-pipeline-tiny v1"
    note = parent.data.tags["mlflow.note.content"]
    assert "[compare the checkpoints side by side](" in note and "workflowType=machine_learning" in note
    # Each stage run names the datasets it read: the prompts, the trajectory shards, the packed data, the benchmarks.
    read = {}
    for stage, run in nested.items():
        inputs = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
        read[stage] = {(d.dataset.name, json.loads(d.dataset.profile)["num_rows"]) for d in inputs}
    assert read["trajectories"] == {("prompts", 12)}
    [store] = [p.parent for p in (stack["root"] / "work" / "trajectories").glob("*/manifest.json")]
    blocks = sum(pq.read_table(f).num_rows for f in store.glob("shard-*.parquet"))  # a row per block trajectory
    assert read["packing"] == {("trajectories", blocks)}
    assert read["training"] == {("packed", 9)}
    assert read["evaluation"] == {("gsm8k", 2), ("humaneval", 1), ("all", 3)}


def prefect_flow_run_name(stack, flow_run_id: str) -> str:
    from uuid import UUID

    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api=stack["env"]["PREFECT_API_URL"]) as client:
        return client.read_flow_run(UUID(flow_run_id)).name


def test_the_mlflow_ui_opens_on_the_models_tab_and_shows_each_checkpoints_figures(stack, two_runs):
    """In a real browser: the link the flow logs opens the experiment in Model training mode on its Models tab
    (not MLflow's GenAI overview), and the figures the page shows for the base and the trained checkpoint are the
    ones the MLflow client returns. With JF_UI_SCREENSHOTS=<folder> it also saves the README's screenshots."""
    from selenium.webdriver.common.by import By

    from tests.support.browser import chromium, close_assistant, models_table, wait_for

    [link] = re.findall(r"compare checkpoints in MLflow: (\S+)", two_runs["logs"])
    _, models = _checkpoints(stack)
    shots = os.environ.get("JF_UI_SCREENSHOTS")
    with chromium() as browser:
        browser.get(link)
        wait_for(browser, lambda b: "Model name" in b.page_source, 90, "the Models table")
        close_assistant(browser)
        body = browser.find_element(By.TAG_NAME, "body").text
        assert "/models" in browser.current_url and "workflowType=machine_learning" in browser.current_url
        # Model training mode: Runs and Models in the side bar, not the GenAI overview or its "Agent versions"
        assert "Runs" in body and "Agent versions" not in body and "Overview" not in body
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(Path(shots) / "mlflow-models.png"))
        table = wait_for(browser, lambda b: (t := models_table(b)) and len(t) == len(models) and t, 60, "every model")
        expected = {f"{b}/{metric}" for b in ("gsm8k", "humaneval", "all") for metric in MODEL_METRICS}
        for name, model in models.items():
            shown = {key: text for key, text in table[name].items() if key in expected}
            client_side = {m.key: m.value for m in model.metrics if m.dataset_name}  # the benchmarks' figures
            assert set(shown) == expected == set(client_side), name  # every figure, on the page and in MLflow
            for key, text in shown.items():
                assert float(text) == pytest.approx(client_side[key], rel=1e-6), (name, key)
        if shots:
            _screenshot_chart_and_run(browser, stack, two_runs, Path(shots))


def _screenshot_chart_and_run(browser, stack, two_runs, folder: Path) -> None:
    """The README's other two screenshots: the Models tab's chart view and the flow's parent run."""
    from mlflow import MlflowClient
    from selenium.webdriver.common.by import By

    from tests.support.browser import wait_for

    charts = browser.find_elements(By.CSS_SELECTOR, "[role=radiogroup] button, [role=radiogroup] label")
    if len(charts) > 1:
        charts[1].click()
        time.sleep(3)
        browser.save_screenshot(str(folder / "mlflow-models-chart.png"))
    experiment = MlflowClient(stack["mlflow"]).get_experiment_by_name("jacobi-forcing")
    runs = MlflowClient(stack["mlflow"]).search_runs([experiment.experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("jacobi_forcing.flow_run_id") == two_runs["second"]]
    browser.get(
        f"{stack['mlflow']}/#/experiments/{experiment.experiment_id}/runs/{parent.info.run_id}"
        "?workflowType=machine_learning"
    )
    wait_for(browser, lambda b: "trained/speedup" in b.page_source, 60, "the parent run's metrics")
    browser.save_screenshot(str(folder / "mlflow-parent-run.png"))
