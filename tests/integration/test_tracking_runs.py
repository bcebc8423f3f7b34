"""A stage's recorded MLflow run is reopened while it exists, and replaced by a fresh one when it was deleted or
the server no longer knows it (a reset database), against a real MLflow server."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from jfcore.contracts import RUN_FILE
from tasks.tracking import TrackingConfig, client, stage_run
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
