"""The evaluation stage: benchmark problems spread over Ray workers, a results table, plots, MLflow.

Every worker loads all the models being compared, so each problem is decoded
by every (model, method) pair side by side on the same hardware. Problems go
out in shards; each finished shard of sample rows is written to Parquet and
listed in the run folder's manifest, so a killed evaluation resumes where it
stopped. The run folder is named by the model fingerprints, the problems and
the decoding settings: a changed input never reuses stale samples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jfcore.atomic import atomic_write
from jfcore.config import ConfigError, check, from_dict, to_dict
from jfcore.contracts import (
    ALL,
    EVALUATION,
    HEADLINE_METHOD_TAG,
    MODEL_METRICS,
    REPORT,
    RUN_FILE,
    SAMPLE_SCHEMA,
    SUMMARY,
    TABLE_METRICS,
)
from jfcore.decoding import DecodeConfig
from jfcore.evaluation.benchmarks import Problem, benchmark_source, load_benchmark
from jfcore.evaluation.config import REFERENCE, DecodingSettings, EvalConfig, EvalModel
from jfcore.evaluation.isolation import require_isolation
from jfcore.evaluation.report import REPORT_FILES, write_report
from jfcore.evaluation.runner import Evaluator, fingerprints, load_models
from jfcore.models import ModelLoadError, load_tokenizer, tokenizer_fingerprint, with_absolute_path
from jfcore.shards import ShardSpec, plan_shards, read_manifest, run_key, write_manifest, write_shard
from tasks import RESULTS_ARTIFACT
from tasks.orchestration import Progress, get_run_logger, markdown_artifact, progress_artifact, task
from tasks.ray_workers import RayConfig, fill_shards, get, ray_session, start_workers
from tasks.tracking import (
    DataInput,
    TrackingConfig,
    checkpoint_model,
    checkpoint_params,
    client,
    log_data_inputs,
    set_model_params,
    stage_run,
)

HEADLINE_ORDER = ("tuned", "multiblock", "jacobi", "hf_prompt_lookup")


@dataclass(frozen=True)
class EvaluationResult:
    folder: str  # the run folder: sample shards and manifest
    report: str  # its report folder: results.md, results.json, samples.parquet, plots
    markdown: str  # the results table
    table: list[dict]  # one row per (benchmark, model, method)
    exact: dict  # outputs equal to greedy decoding: {"equal": n, "checked": m}
    code_isolation: str | None  # how model-written programs ran (None: no code problems)
    dtypes: dict[str, str]  # model label -> the dtype it was evaluated in
    mlflow_run_id: str | None = None
    model_ids: dict[str, str] = dataclasses.field(default_factory=dict)  # model label -> its MLflow LoggedModel id


class EvalWorker:
    """Holds every model under evaluation; turns a shard of problems into a shard of sample rows."""

    def __init__(self, models: dict, decoding: dict, isolated: bool, threads: int):
        import torch

        torch.set_num_threads(threads)
        settings = from_dict(DecodingSettings, decoding, "decoding")
        self.notes: list[str] = []  # why a model decodes untuned (no tune, another machine, a stale tune)
        self.models = load_models(
            {k: from_dict(EvalModel, v, f"models.{k}") for k, v in models.items()}, settings, log=self.notes.append
        )
        self.evaluator = Evaluator(self.models, settings, isolated)

    def fingerprints(self) -> dict[str, dict[str, str]]:
        return fingerprints(self.models)

    def tuned(self) -> dict[str, dict]:
        """Each model's tuned decoding as this worker's machine reads it (part of the run's identity)."""
        return self.evaluator.tuned

    def loading_notes(self) -> list[str]:
        return self.notes

    def run(self, spec: ShardSpec, problems: list[Problem], folder: str):
        rows = self.evaluator.run(problems, offset=spec.start)
        return write_shard(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), Path(folder), spec, len(problems))


def run_evaluation(
    config: EvalConfig,
    ray_config: RayConfig | None = None,
    tracking: TrackingConfig | None = None,
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> EvaluationResult:
    """Evaluate (or finish evaluating) every model on every benchmark; returns the table and where it is."""
    ray_config, tracking = ray_config or RayConfig(), tracking or TrackingConfig()
    # Fail in seconds, before Ray starts: unknown benchmark files, missing models or tokenizers.
    problems = [p for b in config.benchmarks for p in load_benchmark(b, config.data_dir)]
    tokenizers = {label: tokenizer_fingerprint(load_tokenizer(m.model)) for label, m in config.models.items()}
    counts = {b.name: sum(p.benchmark == b.name for p in problems) for b in config.benchmarks}
    log(
        f"{len(problems)} problems ({', '.join(f'{k} {v}' for k, v in counts.items())}) x models "
        f"{', '.join(config.models)} x methods {', '.join(config.decoding.methods)}"
    )
    isolation = code_isolation(config, problems, log)

    # Workers need not share the driver's working folder.
    models = {label: asdict(m) | {"model": asdict(with_absolute_path(m.model))} for label, m in config.models.items()}
    with ray_session(ray_config):
        workers = start_workers(EvalWorker, ray_config, models, asdict(config.decoding), not config.unsafe_no_isolation)
        prints = get(workers[0].fingerprints.remote())
        for label, fp in prints.items():
            if fp["tokenizer"] != tokenizers[label]:
                raise ModelLoadError(
                    f"model {label!r}: the workers loaded another tokenizer than the driver; "
                    "give an absolute name_or_path that every worker can read"
                )
        tuned = get(workers[0].tuned.remote()) if "tuned" in config.decoding.methods else None
        for line in get(workers[0].loading_notes.remote()):
            log(line)
        for label, keys in (tuned or {}).items():
            log(f"tuned: {label} decodes with {from_dict(DecodeConfig, keys, 'tuned').describe()}")
        settings = {
            "models": prints,
            **({"tuned": tuned} if tuned is not None else {}),
            "problems": _digest([(p.benchmark, p.id, p.prompt) for p in problems]),
            "decoding": asdict(config.decoding),
            "problems_per_shard": config.problems_per_shard,
            "sample_columns": SAMPLE_SCHEMA.names,  # shards written with other columns are not reused
            "code_isolation": isolation,  # verdicts given without isolation are never mixed with isolated ones
        }
        folder = Path(config.output_dir).resolve() / run_key(**settings)
        specs = plan_shards(len(problems), config.problems_per_shard)

        def submit(worker, spec: ShardSpec):
            return worker.run.remote(spec, problems[spec.start : spec.stop], str(folder))

        fill_shards(folder, specs, workers, submit, settings, log, progress)

    samples = [row for spec in specs for row in pq.read_table(folder / spec.name).to_pylist()]
    report = write_report(folder / REPORT, samples, config.baseline)
    write_manifest(
        folder, read_manifest(folder) | {"complete": True, "num_problems": len(problems), "code_isolation": isolation}
    )
    log("\n" + report["markdown"])
    result = EvaluationResult(
        str(folder),
        str(folder / REPORT),
        report["markdown"],
        report["table"],
        report["exact"],
        isolation,
        {label: m.model.dtype for label, m in config.models.items()},
    )
    if tracking.uri:
        datasets = benchmark_inputs(config, problems)
        run_id, model_ids = log_evaluation(tracking, folder, config, ray_config, report, datasets, prints, log)
        result = dataclasses.replace(result, mlflow_run_id=run_id, model_ids=model_ids)
    return result


def benchmark_inputs(config: EvalConfig, problems: list[Problem]) -> dict[str, DataInput]:
    """Each benchmark's problems as an MLflow dataset (name, file, digest, rows), and the pooled rows' own."""
    inputs = {}
    for b in config.benchmarks:
        items = [(p.id, p.prompt, p.gold) for p in problems if p.benchmark == b.name]
        inputs[b.name] = DataInput(b.name, benchmark_source(b, config.data_dir), _digest(items), len(items), EVALUATION)
    if len(inputs) > 1:  # the table's pooled rows
        digest = _digest(sorted(i.digest for i in inputs.values()))
        sources = ", ".join(i.source for i in inputs.values())
        inputs[ALL] = DataInput(
            ALL, f"{Path(config.output_dir).resolve()} (pooled: {sources})", digest, len(problems), EVALUATION
        )
    return inputs


def headline_method(methods: tuple[str, ...]) -> str:
    """The method a checkpoint's LoggedModel reports: its tuned decoding when evaluated, else the first of the fixed
    ones, else the reference."""
    return next(m for m in (*HEADLINE_ORDER, REFERENCE) if m in methods)


def code_isolation(config: EvalConfig, problems: list[Problem], log: Callable[[str], None]) -> str | None:
    """How model-written programs will run: refuses to start when they cannot be isolated, unless told it is unsafe."""
    if not any(p.code for p in problems):
        return None
    if config.unsafe_no_isolation:
        log(
            "WARNING: unsafe_no_isolation is set: model-written programs run WITHOUT operating-system isolation, "
            "guarded only by an in-process audit hook that hostile code can defeat; recorded with the results"
        )
        return "unsafe: none (unsafe_no_isolation)"
    require_isolation()
    return "bubblewrap namespaces, unprivileged uid"


def _digest(items: list) -> str:
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def log_evaluation(
    tracking: TrackingConfig,
    folder: Path,
    config: EvalConfig,
    ray_config: RayConfig,
    report: dict,
    datasets: dict[str, DataInput],
    prints: dict[str, dict[str, str]],
    log: Callable[[str], None],
) -> tuple[str, dict[str, str]]:
    """The stage's MLflow run: params, the benchmarks and the evaluated models as inputs, one metric per table
    cell, the report folder as artifacts, the table as the run's description. Every evaluated checkpoint has a
    LoggedModel (its own MLflow model, or one made for it, the base model's included) with its params and its
    headline figures per benchmark. Returns the run id and each model label's LoggedModel id."""
    run_id = stage_run(tracking, folder, EVALUATION, {"evaluation": to_dict(config), "ray": to_dict(ray_config)})
    record = json.loads((folder / RUN_FILE).read_text())
    mlflow = client(tracking)
    if record.get("logged"):  # a rerun of a finished evaluation logs nothing twice
        mlflow.set_terminated(run_id, "FINISHED")
        return run_id, record.get("model_ids", {})
    try:
        model_ids = {
            label: _model_id(mlflow, m.model_uri)
            if m.model_uri
            else checkpoint_model(
                tracking, f"{label} {Path(m.model.name_or_path).name}", prints[label]["model"], run_id
            )
            for label, m in config.models.items()
        }
        for label, model_id in model_ids.items():
            set_model_params(tracking, model_id, checkpoint_params(config.models[label].model))
        log_data_inputs(tracking, run_id, list(datasets.values()), list(model_ids.values()))
        _log_results(mlflow, run_id, config, report, datasets, model_ids, folder / REPORT, log)
    except BaseException:
        mlflow.set_terminated(run_id, "FAILED")  # a rerun logs it again, into the same run
        raise
    record |= {"logged": True, "model_ids": model_ids}
    atomic_write(folder / RUN_FILE, lambda tmp: tmp.write_text(json.dumps(record)))
    mlflow.set_terminated(run_id, "FINISHED")
    return run_id, model_ids


def _log_results(
    mlflow,
    run_id: str,
    config: EvalConfig,
    report: dict,
    datasets: dict[str, DataInput],
    model_ids: dict[str, str],
    report_dir: Path,
    log: Callable[[str], None],
) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    cells = [(row, name) for row in report["table"] for name in TABLE_METRICS if row[name] is not None]
    metrics = [
        Metric(f"{r['benchmark']}/{r['model']}/{r['method']}/{name}", float(r[name]), now, 0) for r, name in cells
    ]
    # Each checkpoint's headline figures against its LoggedModel, per benchmark dataset: the Models tab's columns.
    method = headline_method(config.decoding.methods)
    for label, model_id in model_ids.items():
        rows = [r for r in report["table"] if r["model"] == label and r["method"] == method]
        metrics += [
            Metric(
                f"{r['benchmark']}/{name}",  # MLflow keys a model's metric by name, not by name and dataset
                float(r[column]),
                now,
                0,
                model_id=model_id,
                dataset_name=r["benchmark"],
                dataset_digest=datasets[r["benchmark"]].digest,
            )
            for r in rows
            for name, column in MODEL_METRICS.items()
            if r[column] is not None
        ]
        log(f"results of {label!r} ({method}) logged against MLflow model {model_id}")
    for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
        mlflow.log_batch(run_id, metrics=metrics[start : start + 1000])
    mlflow.set_tag(run_id, HEADLINE_METHOD_TAG, method)
    for name in REPORT_FILES:
        mlflow.log_artifact(run_id, str(report_dir / name), artifact_path=str(Path(EVALUATION, name).parent))
    mlflow.set_tag(run_id, "mlflow.note.content", report["markdown"])


def _model_id(mlflow, model_uri: str) -> str:
    """The MLflow logged-model id behind models:/NAME/VERSION, models:/NAME@ALIAS or models:/m-ID."""
    ref = model_uri.removeprefix("models:/")
    if ref == model_uri:
        raise ConfigError(f"model_uri {model_uri!r}: use models:/NAME/VERSION, models:/NAME@ALIAS or models:/MODEL_ID")
    if "@" not in ref and "/" not in ref:
        return ref
    version = (
        mlflow.get_model_version_by_alias(*ref.split("@", 1))
        if "@" in ref
        else mlflow.get_model_version(*ref.split("/", 1))
    )
    # MLflow 3 registers a logged model with source models:/<model id>; some servers leave model_id empty.
    model_id = version.model_id or (
        version.source.removeprefix("models:/") if version.source.startswith("models:/") else None
    )
    if not model_id:
        raise ConfigError(
            f"model_uri {model_uri!r}: this version was not logged as an MLflow model "
            f"(source {version.source}); give the model's own URI, models:/<model id>"
        )
    return model_id


def _bad_input(task, task_run, state) -> bool:
    """Retry what a rerun can fix (a lost worker, a server hiccup), not a bad recipe."""
    try:
        state.result()
    except (ConfigError, ModelLoadError, FileNotFoundError):
        return False
    except Exception:  # noqa: BLE001
        return True
    return False


def write_summary(results: dict[str, EvaluationResult]) -> Path:
    """`<output folder>/summary.json`: label -> the run's folder, report, table and exactness, for readers of the
    work folder (bench.campaign_report) that have no MLflow."""
    folders = {Path(r.folder).parent for r in results.values()}
    check(len(folders) == 1, f"evaluation summary: the runs lie in {len(folders)} folders, expected one")
    keys = ("folder", "report", "table", "exact", "dtypes")
    summary = {label: {k: getattr(r, k) for k in keys} for label, r in results.items()}
    path = folders.pop() / SUMMARY
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(summary, indent=1)))
    return path


@task(name=EVALUATION, retries=1, retry_delay_seconds=5, retry_condition_fn=_bad_input)
def evaluation_task(
    evaluation: EvalConfig, ray: RayConfig | None = None, tracking: TrackingConfig | None = None
) -> EvaluationResult:
    """The stage in a flow; the table also becomes a Markdown artifact of the flow run."""
    result = run_evaluation(
        evaluation, ray, tracking, log=get_run_logger().info, progress=progress_artifact(EVALUATION)
    )
    write_summary({"base_vs_trained": result})
    markdown_artifact(result.markdown, RESULTS_ARTIFACT, "Evaluation: accuracy and speed of each model and method")
    return result


@task(retries=1, retry_delay_seconds=5, retry_condition_fn=_bad_input)
def evaluation_series_task(
    name: str, configs: dict[str, EvalConfig], ray: RayConfig, tracking: TrackingConfig
) -> dict[str, EvaluationResult]:
    """Several evaluations in turn (a learning curve's points, the float32 check), each resumable on its own;
    `name` labels the log lines. A retry skips the finished ones (their folders are complete)."""
    log, results = get_run_logger().info, {}
    for label, config in configs.items():
        log(f"{name}: {label}")
        results[label] = run_evaluation(config, ray, tracking, log=log)
    write_summary(results)
    return results
