"""MLflow bookkeeping shared by the stages: runs that survive a resume, flat params, models by path."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Self

from jfcore.atomic import atomic_write
from jfcore.config import check, replace_checked
from jfcore.contracts import RUN_FILE

PARAM_LIMIT = 6000  # MLflow's longest param value
# What loading a logged model needs besides the jfcore code stored with it.
REQUIREMENTS = ("torch", "transformers", "accelerate", "safetensors", "numpy", "pyyaml", "gguf", "pyarrow")


@dataclass(frozen=True)
class TrackingConfig:
    uri: str | None = None  # http://127.0.0.1:5000, sqlite:///mlflow.db or a folder; None: no tracking
    experiment: str = "jacobi-forcing"
    run_name: str | None = None
    registered_model: str | None = "jacobi-forcing"  # the registry name of trained models; None: log only
    parent_run_id: str | None = None  # nest this stage's run under a flow's run

    def __post_init__(self) -> None:
        check(self.uri is None or bool(self.uri), "TrackingConfig.uri: empty; leave it out to disable tracking")
        check(bool(self.experiment), "TrackingConfig.experiment: must not be empty")

    @property
    def registry(self) -> bool:
        """Whether trained models are registered (and judged by the gate)."""
        return bool(self.uri and self.registered_model)


def client(config: TrackingConfig):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=config.uri)


def flat_params(data: dict, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}, with values cut to what MLflow stores."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, name + "."))
        else:
            flat[name] = (value if isinstance(value, str) else json.dumps(value))[:PARAM_LIMIT]
    return flat


def new_run(config: TrackingConfig, run_name: str | None, params: dict, tags: dict | None = None) -> str:
    """A run in `config.experiment` (created if missing), nested under `config.parent_run_id`, with flat params."""
    from mlflow.entities import Param

    mlflow = client(config)
    experiment = mlflow.get_experiment_by_name(config.experiment)
    experiment_id = experiment.experiment_id if experiment else mlflow.create_experiment(config.experiment)
    parent = {"mlflow.parentRunId": config.parent_run_id} if config.parent_run_id else {}
    run_id = mlflow.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}) | parent).info.run_id
    items = [Param(k, v) for k, v in flat_params(params).items()]
    for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        mlflow.log_batch(run_id, params=items[start : start + 100])
    return run_id


def stage_run(config: TrackingConfig, folder: Path, stage: str, params: dict) -> str:
    """The stage's MLflow run id: reopened when `folder` already has one on this server, else created with
    params and named `config.run_name` or the stage, so a flow's nested runs read as its stages."""
    mlflow = client(config)
    record = folder / RUN_FILE
    saved = json.loads(record.read_text()) if record.is_file() else {}
    if saved.get("uri") == config.uri:
        if _run_exists(mlflow, saved["run_id"]):
            mlflow.update_run(saved["run_id"], status="RUNNING")
            return saved["run_id"]
        gone = f"MLflow run {saved['run_id']} recorded in {record} was deleted or no longer exists on {config.uri}"
        print(f"warning: {gone}; starting a new run for stage {stage}", flush=True)
    run_id = new_run(config, config.run_name or stage, params, {"jacobi_forcing.stage": stage})
    mlflow.set_tag(run_id, "mlflow.note.content", f"output folder: {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    # A fresh record: a "model" or "logged" mark of an earlier run belonged to that run, so the new one logs again.
    atomic_write(record, lambda tmp: tmp.write_text(json.dumps({"uri": config.uri, "run_id": run_id})))
    return run_id


def _run_exists(mlflow, run_id: str) -> bool:
    """Whether `run_id` is a live run on the server: a deleted run, or a reset database, leaves a stale record."""
    from mlflow.exceptions import MlflowException

    try:
        run = mlflow.get_run(run_id)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return False
    return run.info.lifecycle_stage != "deleted"


def metric_logger(config: TrackingConfig, run_id: str):
    """A callback (step, {name: value}) that logs one step's metrics in one request."""
    import math
    import time

    from mlflow.entities import Metric

    mlflow = client(config)

    def log(step: int, metrics: dict) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if not math.isnan(float(v))]
        try:
            mlflow.log_batch(run_id, metrics=batch)
        except Exception as err:  # noqa: BLE001 (a tracking hiccup must not kill training; metrics.jsonl has every step)
            print(f"warning: MLflow did not take step {step}'s metrics ({err})", flush=True)

    return log


def logged_model(folder: Path) -> dict | None:
    """What `log_model_by_path` logged for the stage in `folder`, if it did."""
    record = folder / RUN_FILE
    return json.loads(record.read_text()).get("model") if record.is_file() else None


# predict()'s parameters and their defaults: "tuned" and block size 0 mean the model's own decoding on the machine
# that loads it (jfcore.metadata.decoding_for); a caller may name a method and a block size instead.
SERVING_PARAMS = {"method": "tuned", "block_size": 0, "max_new_tokens": 256}


def log_model_by_path(config: TrackingConfig, run_id: str, checkpoint: Path, folder: Path) -> dict:
    """Log an HF checkpoint folder as a Jacobi-decoding pyfunc without loading it (no input example),
    and register it when configured. (MLflow's transformers flavor cannot log transformers 5
    checkpoints by path.)"""
    import mlflow
    from mlflow.models import infer_signature

    import jfcore

    here = Path(__file__).resolve().parent
    requirements = [f"{name}=={version(name)}" for name in REQUIREMENTS]
    mlflow.set_tracking_uri(config.uri)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(here / "mlflow_model.py"),
            artifacts={"checkpoint": str(checkpoint)},
            code_paths=[str(Path(jfcore.__file__).parent)],
            pip_requirements=requirements,
            # Declared, not inferred by running the model: text in, text out, decoding settings as params.
            signature=infer_signature(["prompt"], ["completion"], params=SERVING_PARAMS),
            registered_model_name=config.registered_model,
        )
    model = {
        "model_uri": info.model_uri,
        "registered_model": config.registered_model,
        "version": info.registered_model_version,
    }
    record = json.loads((folder / RUN_FILE).read_text()) | {"model": model}
    atomic_write(folder / RUN_FILE, lambda tmp: tmp.write_text(json.dumps(record)))  # a rerun logs no second copy
    return model


def record_stage(
    config: TrackingConfig, run_name: str, stage: str, params: dict, metrics: dict, artifacts: list[Path]
) -> str:
    """A finished MLflow run for a stage that keeps no run of its own (the data stages): its settings,
    figures and files, nested under `config.parent_run_id`."""
    import math
    import time

    from mlflow.entities import Metric

    run_id = new_run(config, run_name, params, {"jacobi_forcing.stage": stage})
    now = int(time.time() * 1000)
    values = [Metric(k, float(v), now, 0) for k, v in metrics.items() if not math.isnan(float(v))]
    mlflow = client(config)
    mlflow.log_batch(run_id, metrics=values)
    for path in artifacts:
        mlflow.log_artifact(run_id, str(path), artifact_path=stage)
    mlflow.set_terminated(run_id, "FINISHED")
    return run_id


class ParentRun:
    """The flow run's MLflow run, which the stages' runs nest under (`tracking`); FAILED if the flow raises.
    Without a tracking URI it is nothing, and `tracking` is the recipe's."""

    def __init__(self, config: TrackingConfig, name: str, params: dict, tags: dict):
        self.config, self.run_id = config, new_run(config, name, params, tags) if config.uri else None
        # the recipe's run_name names this run; the nested runs are named by their stage
        self.tracking = replace_checked(config, parent_run_id=self.run_id, run_name=None) if self.run_id else config

    def describe(self, markdown: str) -> None:
        if self.run_id:
            client(self.config).set_tag(self.run_id, "mlflow.note.content", markdown)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if self.run_id:
            client(self.config).set_terminated(self.run_id, "FAILED" if error_type else "FINISHED")
