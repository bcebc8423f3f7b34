"""The tuning stage: the fastest lossless decoding configuration for a model on this machine (alone: `jf-tune`,
cli/tune.py).

The stage runs after training and before evaluation, on the trained model, and
is reused while the model's tune was measured on this machine with the same
settings. Its report (`tuning/<key>/tune.json`, `tune.png`) holds the cost
curve, every predicted configuration and the confirmed points; MLflow gets a
`tuning` run with the chosen settings and figures, and the logged model's
jacobi_forcing.json is replaced by the tuned one. See jfcore/tuning and
docs/DESIGN.md, section 12.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jfcore.atomic import atomic_write
from jfcore.config import ConfigError, to_dict
from jfcore.contracts import EXPORT_METADATA, EXPORT_SUMS, FINAL, RUN_FILE, TUNED_TAG, TUNING
from jfcore.decoding import DecodeConfig
from jfcore.evaluation.benchmarks import BenchmarkConfig
from jfcore.jacobi_forcing_json import (
    TunedBucket,
    TunedDecoding,
    stale_engine,
    trained_block_size,
    tuned_decoding,
    tuned_keys,
    write_tuned,
)
from jfcore.machine import this_engine, this_machine
from jfcore.models import ModelConfig, resolve_checkpoint, source_fingerprint
from jfcore.shards import run_key
from jfcore.tuning.tuner import TuneConfig, TuneResult
from tasks.orchestration import get_run_logger, task
from tasks.tracking import TrackingConfig, client, stage_run

REPORT_JSON, REPORT_PLOT = "tune.json", "tune.png"


@dataclass(frozen=True)
class TuningResult:
    folder: str  # the report folder: tune.json, tune.png
    checkpoint: str  # the tuned model, whose jacobi_forcing.json now holds the tune
    chosen: dict  # batch size -> the chosen configuration in words and its measured speedup over AR
    reused: bool
    mlflow_run_id: str | None = None


def tune_checkpoint(
    model: ModelConfig,
    config: TuneConfig,
    out_root: str | Path,
    avoid: Sequence[BenchmarkConfig] = (),
    data_dir: str | None = None,
    tracking: TrackingConfig | None = None,
    model_uri: str | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> TuningResult:
    """Tune `model`, write the tune into its checkpoint's jacobi_forcing.json and the report under
    `out_root/<key>`; reuse a tune of this model made on this machine with these settings. `threads`: the torch
    threads the decoding will have (an evaluation or serving worker's), part of the machine's identity."""
    with _torch_threads(threads):
        return _tune(model, config, out_root, avoid, data_dir, tracking, model_uri, log)


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tune(model, config, out_root, avoid, data_dir, tracking, model_uri, log) -> TuningResult:
    import torch

    from jfcore.chat import encode_chat
    from jfcore.decoding import special_tokens
    from jfcore.models import load_model, load_tokenizer
    from jfcore.tuning.split import check_disjoint, load_split
    from jfcore.tuning.tuner import run_tune

    split = load_split(config.split, data_dir)
    check_disjoint(split, avoid, data_dir)  # before loading the model: a bad split fails in seconds
    checkpoint = Path(resolve_checkpoint(model))
    if not checkpoint.is_dir():
        raise ConfigError(f"tuning: {model.name_or_path} is not a local checkpoint folder; tune a downloaded copy")
    machine = this_machine(model.device, model.dtype)
    kernels = DecodeConfig()  # the tuner decodes with the default kernels
    engine = this_engine(kernels)
    folder = Path(out_root).resolve() / run_key(
        model=source_fingerprint(model), tune=to_dict(config), machine=machine.as_dict(), engine=engine.as_dict()
    )
    existing = tuned_decoding(checkpoint)
    here = existing is not None and not existing.machine.differences(machine)
    if here and existing.report == str(folder):  # the folder's key holds the engine: the same one
        log(f"tuning: reused {folder} (this model was tuned on this machine with these settings)")
        return TuningResult(str(folder), str(checkpoint), _chosen(existing), reused=True)
    if here and (stale := stale_engine(existing, kernels)):
        log(f"tuning: the model's tune of {existing.date} is stale ({stale}); measuring again")

    loaded, _ = load_model(model)
    tokenizer = load_tokenizer(model)
    eos, pad = special_tokens(loaded, None, tokenizer.pad_token_id)
    prompts = [encode_chat(tokenizer, p.ask) for p in split]
    trained_n = trained_block_size(checkpoint)
    with torch.inference_mode():
        result = run_tune(loaded, prompts, config, eos, pad, trained_n, log)
    folder.mkdir(parents=True, exist_ok=True)
    record = report(result, config, model, [p.source for p in split]) | {"engine": engine.as_dict()}
    atomic_write(folder / REPORT_JSON, lambda tmp: tmp.write_text(json.dumps(record, indent=1)))
    plot(record, folder / REPORT_PLOT)
    tuned = TunedDecoding(
        machine=machine,
        engine=engine,
        buckets=tuple(
            TunedBucket(b.batch_size, b.chosen.config, b.chosen.predicted, b.chosen.measured) for b in result.buckets
        ),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        report=str(folder),
    )
    write_tuned(checkpoint, tuned)
    if (checkpoint.parent / EXPORT_SUMS).is_file() and checkpoint.name == FINAL:
        from jfcore.training.checkpoints import write_export_sums

        write_export_sums(checkpoint.parent)  # the export changed by the tuning stage's own hand: still reusable
    run_id = None
    if tracking and tracking.uri:
        run_id = log_tuning(tracking, folder, config, record, checkpoint, model_uri)
    log(f"tuning: {folder} ({result.seconds:.0f} s); " + "; ".join(f"{k}: {v}" for k, v in _chosen(tuned).items()))
    return TuningResult(str(folder), str(checkpoint), _chosen(tuned), reused=False, mlflow_run_id=run_id)


def _chosen(tuned: TunedDecoding) -> dict:
    return {
        f"batch {b.batch_size}": f"{b.decoding.describe()} ({b.measured_speedup:.2f}x AR measured)"
        for b in tuned.buckets
    }


def report(result: TuneResult, config: TuneConfig, model: ModelConfig, sources: list[str]) -> dict:
    """Everything the tune measured and decided, as plain data (tune.json; published benchmarks use it too)."""

    def confirmed(c) -> dict:
        return {
            "config": c.config.describe(),
            "decoding": tuned_keys(c.config),
            "predicted_speedup": round(c.predicted, 4),
            "measured_speedup": round(c.measured, 4),
            "rounds": [round(r, 4) for r in c.rounds],
            "error": round(c.error, 4),
            "tpf": round(c.tpf, 4),
            "exact": c.exact,
        }

    return {
        "model": model.name_or_path,
        "machine": result.machine.as_dict(),
        "settings": to_dict(config),
        "split": sorted(set(sources)),
        "seconds": round(result.seconds, 1),
        "acceptance": result.acceptance.as_dict(),
        "buckets": [
            {
                "batch_size": b.batch_size,
                "curve": b.curve.as_dict(),
                "chosen": confirmed(b.chosen),
                "confirmed": [confirmed(c) for c in b.confirmed],
                "surface": [
                    {"config": p.config.describe(), "decoding": tuned_keys(p.config), **p.as_dict()} for p in b.surface
                ],
            }
            for b in result.buckets
        ],
    }


def plot(record: dict, path: Path) -> None:
    """Three panels per bucket: the cost curve, the predicted surface over (n, candidate length), and predicted
    against measured speedup of the confirmed points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = record["buckets"]
    fig, axes = plt.subplots(len(buckets), 3, figsize=(15, 4.2 * len(buckets)), squeeze=False)
    for row, b in zip(axes, buckets):
        curve = b["curve"]
        row[0].plot(curve["widths"], curve["ratio"], marker="o")
        row[0].set(xlabel="query positions q", ylabel="t(q) / t(1)", title=f"cost curve, batch {b['batch_size']}")
        row[0].grid(alpha=0.3)
        best: dict[tuple[int, int], float] = {}
        for p in b["surface"]:
            d = p["decoding"]
            if d["method"] != "multiblock":
                key = (d["block_size"], d["lookup_tokens"])
                best[key] = max(best.get(key, 0.0), p["speedup"])
        ns = sorted({k[0] for k in best})
        ls = sorted({k[1] for k in best})
        grid = [[best.get((n, t), float("nan")) for t in ls] for n in ns]
        image = row[1].imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        row[1].set_xticks(range(len(ls)), ls)
        row[1].set_yticks(range(len(ns)), ns)
        row[1].set(xlabel="prompt-lookup candidate tokens", ylabel="block size n", title="predicted speedup over AR")
        fig.colorbar(image, ax=row[1])
        confirmed = b["confirmed"]
        xs, ys = [c["predicted_speedup"] for c in confirmed], [c["measured_speedup"] for c in confirmed]
        row[2].scatter(xs, ys)
        for c, x, y in zip(confirmed, xs, ys):
            row[2].annotate(c["config"], (x, y), fontsize=7)
        low, high = min(xs + ys) * 0.95, max(xs + ys) * 1.05
        row[2].plot([low, high], [low, high], color="grey", lw=0.8)
        row[2].set(xlabel="predicted speedup", ylabel="measured speedup (median)", title="confirmed points")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_tuning(
    tracking: TrackingConfig, folder: Path, config: TuneConfig, record: dict, checkpoint: Path, model_uri: str | None
) -> str:
    """A `tuning` run: the settings, the chosen configuration and its figures per bucket, the report; and the logged
    model's jacobi_forcing.json replaced by the tuned one, so a registered version serves with its tune."""
    import math

    from mlflow.entities import Metric

    run_id = stage_run(tracking, folder, TUNING, {"tuning": to_dict(config), "machine": record["machine"]})
    mlflow = client(tracking)
    now = int(time.time() * 1000)
    metrics = []
    for b in record["buckets"]:
        prefix = f"batch{b['batch_size']}"
        chosen = b["chosen"]
        metrics += [
            Metric(f"{prefix}/speedup_measured", chosen["measured_speedup"], now, 0),
            Metric(f"{prefix}/speedup_predicted", chosen["predicted_speedup"], now, 0),
            Metric(f"{prefix}/tpf", chosen["tpf"], now, 0),
        ]
        metrics += [
            Metric(f"{prefix}/cost_ratio_q{w}", r, now, 0) for w, r in zip(b["curve"]["widths"], b["curve"]["ratio"])
        ]
        for i, point in enumerate(b["confirmed"]):  # predicted against measured, point by point
            metrics += [
                Metric(f"{prefix}/confirmed{i}/speedup_predicted", point["predicted_speedup"], now, 0),
                Metric(f"{prefix}/confirmed{i}/speedup_measured", point["measured_speedup"], now, 0),
            ]
            mlflow.set_tag(run_id, f"{TUNED_TAG}{prefix}.confirmed{i}", point["config"])
        for key, value in chosen["decoding"].items():
            mlflow.set_tag(run_id, f"{TUNED_TAG}{prefix}.{key}", str(value))
    mlflow.log_batch(run_id, metrics=[m for m in metrics if not math.isnan(m.value)])
    for name in (REPORT_JSON, REPORT_PLOT):
        mlflow.log_artifact(run_id, str(folder / name), artifact_path=TUNING)
    mlflow.log_artifact(run_id, str(checkpoint / EXPORT_METADATA), artifact_path=TUNING)
    if model_uri and model_uri.startswith("models:/m-"):
        model_id = model_uri.removeprefix("models:/")  # log_model_by_path put the folder at artifacts/<its name>
        mlflow.log_model_artifact(model_id, str(checkpoint / EXPORT_METADATA), f"artifacts/{checkpoint.name}")
    mlflow.set_terminated(run_id, "FINISHED")
    atomic_write(folder / RUN_FILE, lambda tmp: tmp.write_text(json.dumps({"uri": tracking.uri, "run_id": run_id})))
    return run_id


@task(name=TUNING)
def tuning_task(
    model: ModelConfig,
    config: TuneConfig,
    out_root: str,
    avoid: tuple[BenchmarkConfig, ...],
    data_dir: str | None,
    tracking: TrackingConfig | None,
    model_uri: str | None = None,
    threads: int | None = None,
) -> TuningResult:
    """The stage in a flow: tune a model before it is evaluated (the trained model, and the base model and champion
    it is judged against), with an evaluation worker's threads; `tracking` None logs no MLflow run."""
    log = get_run_logger().info
    return tune_checkpoint(model, config, out_root, avoid, data_dir, tracking, model_uri, threads, log)
