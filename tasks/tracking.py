"""MLflow bookkeeping shared by the stages: runs that survive a resume, flat params, models by path."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Self

from jfcore.atomic import atomic_write
from jfcore.config import ConfigError, check, replace_checked
from jfcore.contracts import FINGERPRINT_TAG, RUN_FILE, STAGE_TAG

PARAM_LIMIT = 6000  # MLflow's longest param value
# MLflow's experiment kind: these are model training experiments ("Machine learning" in the UI), not GenAI ones.
KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
UI_MODES = {TRAINING_KIND: "machine_learning", "genai_development": "genai"}  # kind -> the UI's workflowType
# What loading a logged model needs besides the jfcore code stored with it.
REQUIREMENTS = ("torch", "transformers", "accelerate", "safetensors", "numpy", "pyyaml", "gguf", "pyarrow")


@dataclass(frozen=True, kw_only=True)
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


def experiment_id(config: TrackingConfig) -> str:
    """`config.experiment`'s id, created if missing. It is marked a training experiment; one that has no kind yet
    (created by an earlier release) gets the mark now, and a kind someone chose stays."""
    mlflow = client(config)
    experiment = mlflow.get_experiment_by_name(config.experiment)
    if experiment is None:
        return mlflow.create_experiment(config.experiment, tags={KIND_TAG: TRAINING_KIND})
    if KIND_TAG not in experiment.tags:
        mlflow.set_experiment_tag(experiment.experiment_id, KIND_TAG, TRAINING_KIND)
    return experiment.experiment_id


def models_link(config: TrackingConfig) -> str | None:
    """The experiment's Models tab in the MLflow UI, where checkpoints compare side by side, in the UI mode its kind
    tag names. (MLflow 3.17's UI takes the mode from the URL or its "GenAI / Model training" switch, not from the
    tag: a plain experiment link opens the GenAI overview.) None without an MLflow server."""
    if not (config.uri or "").startswith(("http://", "https://")):
        return None
    experiment = client(config).get_experiment_by_name(config.experiment)
    if experiment is None:
        return None
    mode = UI_MODES.get(experiment.tags.get(KIND_TAG, ""))
    return f"{config.uri.rstrip('/')}/#/experiments/{experiment.experiment_id}/models" + (
        f"?workflowType={mode}" if mode else ""
    )


@dataclass(frozen=True)
class DataInput:
    """A dataset a run read, as MLflow lists it beside the run (and links model metrics to)."""

    name: str
    source: str  # the file or folder (an absolute path) or hub id it was read from
    digest: str
    rows: int
    context: str  # what the run used it for: prompts, trajectories, training, evaluation

    def entity(self):
        from mlflow.entities import Dataset, DatasetInput, InputTag

        source_type = "local" if Path(self.source).is_absolute() else "hugging_face"  # else a hub id
        dataset = Dataset(
            self.name,
            self.digest,
            source_type,
            json.dumps({"uri": self.source}),
            profile=json.dumps({"num_rows": self.rows}),
        )
        return DatasetInput(dataset, [InputTag("mlflow.data.context", self.context)])


def packed_input(folder: str | Path, sequences: int) -> DataInput:
    """A packing output as the dataset training reads (its folder name is the digest of its inputs)."""
    folder = Path(folder).resolve()
    return DataInput("packed", str(folder), folder.name, sequences, "training")


def log_data_inputs(config: TrackingConfig, run_id: str, inputs: list[DataInput], model_ids: list[str] = ()) -> None:
    """The datasets (and MLflow models) a run used, once: a resumed run that lists them already adds nothing."""
    from mlflow.entities import LoggedModelInput

    mlflow = client(config)
    logged = mlflow.get_run(run_id).inputs
    known = {(d.dataset.name, d.dataset.digest) for d in logged.dataset_inputs}
    known_models = {m.model_id for m in logged.model_inputs or []}
    datasets = [i.entity() for i in inputs if (i.name, i.digest) not in known]
    models = [LoggedModelInput(m) for m in model_ids if m not in known_models]
    if datasets or models:
        mlflow.log_inputs(run_id, datasets=datasets, models=models)


def model_name(text: str) -> str:
    """`text` as a LoggedModel name (MLflow refuses / : . % and quotes in one)."""
    return "".join(c if c.isalnum() or c in "-_ " else "-" for c in text)


def checkpoint_model(config: TrackingConfig, name: str, fingerprint: str, source_run_id: str) -> str:
    """The LoggedModel that stands for a checkpoint MLflow holds no model of (the base model, a folder evaluated on
    its own): found by its fingerprint, created (as `name`) the first time it is evaluated, so every evaluation of
    it adds to one row of the experiment's Models tab."""
    from mlflow.entities import LoggedModelStatus

    mlflow = client(config)
    experiment = experiment_id(config)
    found = mlflow.search_logged_models([experiment], f"tags.`{FINGERPRINT_TAG}` = '{fingerprint}'", max_results=1)
    if found:
        return found[0].model_id
    model = mlflow.create_logged_model(experiment, model_name(name), source_run_id, {FINGERPRINT_TAG: fingerprint})
    mlflow.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return model.model_id


def checkpoint_params(model) -> dict[str, str]:
    """What a checkpoint's LoggedModel shows (jfcore.models.ModelConfig `model`): where it comes from, the block size
    and steps it was trained with and its training folder (the digest of its settings and data), and the decoding
    tuned for it."""
    from jfcore.jacobi_forcing_json import read_metadata, tuned_decoding

    folder = Path(model.name_or_path)
    data = read_metadata(folder) if folder.is_dir() else {}
    tuned = tuned_decoding(folder) if folder.is_dir() else None
    return {
        "source": model.name_or_path + (f" ({model.gguf_file})" if model.gguf_file else ""),
        "trained_block_size": str(data.get("block_size", "-")),
        "training_steps": str(data.get("steps", 0)),
        "training_folder": folder.parent.name if "training" in data else "-",
        "tuned_decoding": "; ".join(f"batch {b.batch_size}: {b.decoding.describe()}" for b in tuned.buckets)
        if tuned
        else "-",
    }


def set_model_params(config: TrackingConfig, model_id: str, params: dict[str, str]) -> None:
    """Params of a LoggedModel, each set once (MLflow refuses to set one twice, even to the same value)."""
    mlflow = client(config)
    have = mlflow.get_logged_model(model_id).params
    missing = {k: v[:PARAM_LIMIT] for k, v in params.items() if k not in have}
    if missing:
        mlflow.log_model_params(model_id, missing)


def new_run(config: TrackingConfig, run_name: str | None, params: dict, tags: dict | None = None) -> str:
    """A run in `config.experiment` (created if missing), nested under `config.parent_run_id`, with flat params."""
    from mlflow.entities import Param

    mlflow = client(config)
    parent = {"mlflow.parentRunId": config.parent_run_id} if config.parent_run_id else {}
    run_id = mlflow.create_run(experiment_id(config), run_name=run_name, tags=dict(tags or {}) | parent).info.run_id
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
    run_id = new_run(config, config.run_name or stage, params, {STAGE_TAG: stage})
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
# that loads it (jfcore.jacobi_forcing_json.decoding_for); a caller may name a method and a block size instead.
SERVING_PARAMS = {"method": "tuned", "block_size": 0, "max_new_tokens": 256}


def log_model_by_path(config: TrackingConfig, run_id: str, checkpoint: Path, folder: Path, step: int = 0) -> dict:
    """Log an HF checkpoint folder as a Jacobi-decoding pyfunc without loading it (no input example),
    and register it when configured. (MLflow's transformers flavor cannot log transformers 5
    checkpoints by path.) MLflow links the run's metrics at `step` to the model: training passes its last
    step, so the checkpoint's row in the Models tab carries its final loss and held-out acceptance."""
    import mlflow
    from mlflow.models import infer_signature

    import jfcore

    here = Path(__file__).resolve().parent
    requirements = [f"{name}=={version(name)}" for name in REQUIREMENTS]
    mlflow.set_tracking_uri(config.uri)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name=model_name(f"trained {folder.name}"),  # the Models tab's row; the training folder's digest
            python_model=str(here / "mlflow_model.py"),
            artifacts={"checkpoint": str(checkpoint)},
            code_paths=[str(Path(jfcore.__file__).parent)],
            pip_requirements=requirements,
            # Declared, not inferred by running the model: text in, text out, decoding settings as params.
            signature=infer_signature(["prompt"], ["completion"], params=SERVING_PARAMS),
            registered_model_name=config.registered_model,
            step=step,
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
    config: TrackingConfig,
    run_name: str,
    stage: str,
    params: dict,
    metrics: dict,
    artifacts: list[Path],
    inputs: list[DataInput] = (),
) -> str:
    """A finished MLflow run for a stage that keeps no run of its own (the data stages): its settings,
    figures, files and the datasets it read, nested under `config.parent_run_id`."""
    import math
    import time

    from mlflow.entities import Metric

    run_id = new_run(config, run_name, params, {STAGE_TAG: stage})
    now = int(time.time() * 1000)
    values = [Metric(k, float(v), now, 0) for k, v in metrics.items() if not math.isnan(float(v))]
    mlflow = client(config)
    mlflow.log_batch(run_id, metrics=values)
    log_data_inputs(config, run_id, list(inputs))
    for path in artifacts:
        mlflow.log_artifact(run_id, str(path), artifact_path=stage)
    mlflow.set_terminated(run_id, "FINISHED")
    return run_id


def require_server(config: TrackingConfig, timeout_s: float = 5.0) -> None:
    """An MLflow server that does not answer fails the run at once, saying what to do, rather than after
    MLflow's minutes of retries in the middle of a stage."""
    if not (config.uri or "").startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{config.uri.rstrip('/')}/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # a server answered
    except OSError as err:  # URLError, refused, timed out
        raise ConfigError(
            f"tracking.uri: no MLflow server answers at {config.uri} ({getattr(err, 'reason', err)}); start one "
            "(python infra/stack.py up), or run without MLflow: leave tracking.uri out (--set tracking.uri=null)"
        ) from None


class ParentRun:
    """The flow run's MLflow run, which the stages' runs nest under (`tracking`); FAILED if the flow raises.
    Without a tracking URI it is nothing, and `tracking` is the recipe's."""

    def __init__(self, config: TrackingConfig, name: str, params: dict, tags: dict):
        require_server(config)
        self.config, self.name = config, name
        self.run_id = new_run(config, name, params, tags) if config.uri else None
        # the recipe's run_name names this run; the nested runs are named by their stage
        self.tracking = replace_checked(config, parent_run_id=self.run_id, run_name=None) if self.run_id else config

    def summarize(self, markdown: str, metrics: dict[str, float], tags: dict[str, str]) -> None:
        """The run's description, headline metrics and tags."""
        if not self.run_id:
            return
        import time

        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        client(self.config).log_batch(
            self.run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
            tags=[RunTag(k, v) for k, v in (tags | {"mlflow.note.content": markdown}).items()],
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if self.run_id:
            client(self.config).set_terminated(self.run_id, "FAILED" if error_type else "FINISHED")
