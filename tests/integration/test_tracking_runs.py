"""MLflow bookkeeping against a real MLflow server: a stage's recorded run is reopened while it exists and replaced
when it was deleted or the server no longer knows it (a reset database); experiments are marked for training;
checkpoints get LoggedModels; runs list the datasets they read."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from jfcore.contracts import RUN_FILE
from tasks.tracking import (
    FINGERPRINT_TAG,
    KIND_TAG,
    TRAINING_KIND,
    DataInput,
    TrackingConfig,
    checkpoint_model,
    client,
    log_data_inputs,
    models_link,
    new_run,
    set_model_params,
    stage_run,
)
from tests.support.servers import mlflow_server


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrackingConfig]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield TrackingConfig(uri=uri, experiment="stage-run-tests")


def recorded(folder: Path) -> dict:
    return json.loads((folder / RUN_FILE).read_text())


def assert_fresh_run(tracking: TrackingConfig, folder: Path, run_id: str, old_run_id: str) -> None:
    run = client(tracking).get_run(run_id)
    assert run_id != old_run_id
    assert (run.info.status, run.info.lifecycle_stage) == ("RUNNING", "active")
    assert run.data.tags["jacobi_forcing.stage"] == "training" and run.data.params["lr"] == "0.001"
    assert recorded(folder) == {"uri": tracking.uri, "run_id": run_id}  # no "model"/"logged" of the old run


def test_a_live_run_is_reopened(tracking: TrackingConfig, tmp_path: Path) -> None:
    run_id = stage_run(tracking, tmp_path, "training", {"lr": 0.001})
    client(tracking).set_terminated(run_id, "FAILED")
    assert stage_run(tracking, tmp_path, "training", {"lr": 0.001}) == run_id
    assert client(tracking).get_run(run_id).info.status == "RUNNING"


def test_a_deleted_run_is_replaced(tracking: TrackingConfig, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    old = stage_run(tracking, tmp_path, "training", {"lr": 0.001})
    marks = recorded(tmp_path) | {"model": {"model_uri": "models:/m-1"}, "logged": True}  # as later stages add
    (tmp_path / RUN_FILE).write_text(json.dumps(marks))
    client(tracking).delete_run(old)
    new = stage_run(tracking, tmp_path, "training", {"lr": 0.001})
    assert_fresh_run(tracking, tmp_path, new, old)
    assert f"warning: MLflow run {old} recorded in {tmp_path / RUN_FILE} was deleted" in capsys.readouterr().out


def test_a_run_the_server_never_had_is_replaced(
    tracking: TrackingConfig, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    unknown = uuid.uuid4().hex  # as after the MLflow database was reset
    (tmp_path / RUN_FILE).write_text(json.dumps({"uri": tracking.uri, "run_id": unknown, "logged": True}))
    new = stage_run(tracking, tmp_path, "training", {"lr": 0.001})
    assert_fresh_run(tracking, tmp_path, new, unknown)
    assert f"warning: MLflow run {unknown} recorded in" in capsys.readouterr().out


def test_experiments_are_marked_for_training_and_linked_to_their_models_tab(tracking: TrackingConfig) -> None:
    """A new experiment is created as a training experiment; one an earlier release created without a kind gets
    the mark on its next run; a kind someone chose stays. The Models tab link opens the UI in the mode the kind
    names (MLflow 3.17's UI reads the mode from the link, not from the tag)."""
    mlflow = client(tracking)
    fresh = TrackingConfig(uri=tracking.uri, experiment="kind-fresh")
    new_run(fresh, "r", {})
    old = mlflow.create_experiment("kind-old")  # as an earlier release left it: no kind
    assert KIND_TAG not in mlflow.get_experiment(old).tags
    new_run(TrackingConfig(uri=tracking.uri, experiment="kind-old"), "r", {})
    chosen = mlflow.create_experiment("kind-chosen", tags={KIND_TAG: "genai_development"})
    new_run(TrackingConfig(uri=tracking.uri, experiment="kind-chosen"), "r", {})
    kinds = {
        name: mlflow.get_experiment_by_name(name).tags[KIND_TAG] for name in ("kind-fresh", "kind-old", "kind-chosen")
    }
    assert kinds == {"kind-fresh": TRAINING_KIND, "kind-old": TRAINING_KIND, "kind-chosen": "genai_development"}
    fresh_id = mlflow.get_experiment_by_name("kind-fresh").experiment_id
    assert models_link(fresh) == f"{tracking.uri}/#/experiments/{fresh_id}/models?workflowType=machine_learning"
    genai = models_link(TrackingConfig(uri=tracking.uri, experiment="kind-chosen"))
    assert genai == f"{tracking.uri}/#/experiments/{chosen}/models?workflowType=genai"
    assert models_link(TrackingConfig(uri="sqlite:///x.db")) is None  # no server, no UI


def test_a_checkpoint_without_an_mlflow_model_gets_one_logged_model(tracking: TrackingConfig) -> None:
    """The base model's LoggedModel is made once per fingerprint and found again by later evaluations; its params
    are set once (MLflow refuses a second value), later keys added."""
    run_id = new_run(tracking, "evaluation", {})
    first = checkpoint_model(tracking, "base smollm2.gguf", "fingerprint-a", run_id)
    assert checkpoint_model(tracking, "base smollm2.gguf", "fingerprint-a", new_run(tracking, "again", {})) == first
    other = checkpoint_model(tracking, "base other", "fingerprint-b", run_id)
    assert other != first
    model = client(tracking).get_logged_model(first)
    assert (model.name, model.source_run_id, model.tags[FINGERPRINT_TAG]) == (
        "base smollm2-gguf",
        run_id,
        "fingerprint-a",
    )
    set_model_params(tracking, first, {"source": "a", "training_steps": "0"})
    set_model_params(tracking, first, {"source": "b", "recipe_digest": "d"})
    assert client(tracking).get_logged_model(first).params == {
        "source": "a",
        "training_steps": "0",
        "recipe_digest": "d",
    }


def test_dataset_inputs_name_their_source_digest_and_rows_once(tracking: TrackingConfig, tmp_path: Path) -> None:
    run_id = new_run(tracking, "packing", {})
    store = str(tmp_path / "store")  # an absolute path: a local dataset
    shards = DataInput("trajectories", store, "abc123", 42, "trajectories")
    log_data_inputs(tracking, run_id, [shards])
    log_data_inputs(tracking, run_id, [shards, DataInput("prompts", "builtin", "p1", 7, "prompts")])  # a resume
    inputs = client(tracking).get_run(run_id).inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("trajectories", "abc123"), ("prompts", "p1")]
    first = inputs[0]
    assert json.loads(first.dataset.source) == {"uri": store} and first.dataset.source_type == "local"
    assert json.loads(first.dataset.profile) == {"num_rows": 42}
    assert [(t.key, t.value) for t in first.tags] == [("mlflow.data.context", "trajectories")]
