"""Model registry: the newly trained version becomes the `challenger`, and the `champion` when it passes the gate.

The gate compares pooled evaluation rows (all benchmarks) under one decoding
method. Speedup is a ratio to the base model's HF greedy measured in the same
run, so it compares across runs; accuracy compares when the benchmarks do.
With no champion yet, the base model is the bar: its greedy accuracy and a
speedup of 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jfcore.config import check, from_dict
from jfcore.eval.report import ALL
from tasks.orchestration import get_run_logger, task
from tasks.tracking import TrackingConfig, client

CHALLENGER, CHAMPION = "challenger", "champion"
TAG = "jacobi_forcing.eval."  # model version tags holding the gate's figures


@dataclass(frozen=True)
class GateConfig:
    method: str = "multiblock"  # the decoding method the models are compared under
    max_accuracy_drop: float = 0.01  # accuracy may fall by at most this much (0.01 = one point)
    min_speedup_gain: float = 0.0  # the speedup must beat the bar's by more than this

    def __post_init__(self) -> None:
        check(self.method in ("jacobi", "multiblock"), f"gate.method: {self.method!r} is not jacobi or multiblock")
        check(0 <= self.max_accuracy_drop <= 1,
              f"gate.max_accuracy_drop: must be in [0, 1], got {self.max_accuracy_drop}")  # fmt: skip


def pooled(table: list[dict], model: str, method: str) -> dict:
    rows = [r for r in table if r["model"] == model and r["method"] == method]
    return next((r for r in rows if r["benchmark"] == ALL), rows[0])  # one benchmark has no "all" row


def promote(tracking: TrackingConfig, version: str, table: list[dict], gate: GateConfig,
            log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Tag `version` with its figures, make it the challenger, and the champion if it passes the gate."""
    from mlflow.exceptions import MlflowException

    name, mlflow = tracking.registered_model, client(tracking)
    new = pooled(table, "trained", gate.method)
    figures = {"method": gate.method, "accuracy": new["accuracy"], "speedup": new["speedup"], "tpf": new["tpf"]}
    for key, value in figures.items():
        mlflow.set_model_version_tag(name, version, TAG + key, str(value))
    mlflow.set_registered_model_alias(name, CHALLENGER, version)
    try:
        champion = mlflow.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        champion = None
    if champion is not None and TAG + "accuracy" in champion.tags:
        bar = {"who": f"champion v{champion.version}", "accuracy": float(champion.tags[TAG + "accuracy"]),
               "speedup": float(champion.tags[TAG + "speedup"])}  # fmt: skip
    else:
        bar = {"who": "the base model", "accuracy": pooled(table, "base", "hf_greedy")["accuracy"], "speedup": 1.0}
    accurate = new["accuracy"] >= bar["accuracy"] - gate.max_accuracy_drop
    faster = new["speedup"] is not None and new["speedup"] > bar["speedup"] + gate.min_speedup_gain
    reason = (f"v{version} ({gate.method}): accuracy {new['accuracy']:.1%} vs {bar['accuracy']:.1%} of {bar['who']} "
              f"(allowed drop {gate.max_accuracy_drop:.1%}), speedup {new['speedup']:.2f}x vs {bar['speedup']:.2f}x")  # fmt: skip
    if accurate and faster:
        mlflow.set_registered_model_alias(name, CHAMPION, version)
        log(f"promoted to {CHAMPION}: {reason}")
    else:
        log(f"stays {CHALLENGER} ({'too slow' if accurate else 'accuracy fell too far'}): {reason}")
    return {"version": version, "promoted": accurate and faster, "reason": reason,
            CHAMPION: version if accurate and faster else (champion.version if champion else None)}  # fmt: skip


@task(name="register")
def register_task(tracking: dict, version: str, table: list[dict], gate: dict) -> dict:
    """Prefect task over `promote`."""
    return promote(from_dict(TrackingConfig, tracking, "tracking"), version, table, from_dict(GateConfig, gate, "gate"),
                   log=get_run_logger().info)  # fmt: skip
