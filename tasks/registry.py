"""Model registry: the newly trained version becomes the `challenger`, and the `champion` when it passes the gate.

The gate reads one evaluation in which the trained model, the base model and
the current champion (if any) decoded the same problems side by side, pooled
over all benchmarks under one decoding method (`tuned` by default: each model's
own tune for this machine, on the same kernels). The bar is the champion, or
with no champion yet the base model, under that same method, so the gate
judges what training added rather than what the engine adds to any model.
The evaluation times the method in `rounds` interleaved rounds per problem;
the trained model passes when it solves at most `max_accuracy_drop_problems`
fewer problems than the bar, is faster than the bar by more than
`min_speedup_gain` in every round (a gain inside the rounds' spread is noise),
and (with `require_exact`) every one of its outputs equals greedy decoding in
a float32 evaluation. Its text may repeat itself at most `max_repetition_gain` more than the bar's (the share
of tokens closing a 4-gram the completion already held): a loop drafts itself, so a model that drifted into
loops decodes faster without drafting any better. The decision and its reason become tags of the version.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jfcore.atomic import atomic_write
from jfcore.config import check
from jfcore.contracts import ALL, GATE_DECISION_TAG, GATE_FIGURES_TAG, GATE_REASON_TAG, REGISTRY
from jfcore.evaluation.report import round_ratios
from tasks import GATE_ARTIFACT
from tasks.orchestration import get_run_logger, markdown_artifact, task
from tasks.tracking import TrackingConfig, client

if TYPE_CHECKING:  # the registry's configs load without the evaluation and training stacks
    from tasks.evaluation import EvaluationResult
    from tasks.training import TrainingResult

CHALLENGER, CHAMPION = "challenger", "champion"
PROMOTED, REJECTED = "promoted", "rejected"


@dataclass(frozen=True)
class RegistryResult:
    version: str  # the version the gate judged
    promoted: bool
    reason: str  # the gate's figures, in one line
    champion: str | None  # the champion's version afterwards


@dataclass(frozen=True)
class Champion:
    version: str
    checkpoint: str  # its HF checkpoint folder, downloaded once
    model_uri: str

    def rivals(self, trained: TrainingResult) -> tuple[str, str] | None:
        """(checkpoint, model URI) to evaluate beside the trained model, unless that is the champion itself."""
        return None if trained.version == self.version else (self.checkpoint, self.model_uri)


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    method: str = "tuned"  # the decoding method the models are compared under: each model's tune for this machine
    max_accuracy_drop_problems: int = 0  # the trained model may solve at most this many fewer problems than the bar
    min_speedup_gain: float = 0.0  # in every round its speed over the bar's must exceed 1 + this
    rounds: int = 3  # interleaved timing rounds of `method` per problem (evaluation.decoding.timing_rounds)
    require_exact: bool = True  # every output equal to greedy decoding, checked in a float32 evaluation
    # The trained model's repeated-4-gram share may exceed the bar's by at most this (absolute); null: unchecked.
    max_repetition_gain: float | None = 0.1

    def __post_init__(self) -> None:
        check(
            self.method in ("tuned", "jacobi", "multiblock"),
            f"gate.method: {self.method!r} is not tuned, jacobi or multiblock",
        )
        check(
            self.max_accuracy_drop_problems >= 0,
            f"gate.max_accuracy_drop_problems: must be >= 0, got {self.max_accuracy_drop_problems}",
        )
        check(self.rounds >= 2, f"gate.rounds: the spread needs >= 2 timing rounds, got {self.rounds}")
        check(
            self.max_repetition_gain is None or self.max_repetition_gain >= 0,
            f"gate.max_repetition_gain: must be >= 0 (or null: unchecked), got {self.max_repetition_gain}",
        )


def pooled(table: list[dict], model: str, method: str) -> dict:
    rows = [r for r in table if r["model"] == model and r["method"] == method]
    return next((r for r in rows if r["benchmark"] == ALL), rows[0])  # one benchmark has no "all" row


def _solved(row: dict) -> int:
    return round(row["accuracy"] * row["samples"])


def decide(table: list[dict], gate: GateConfig, champion: str | None, float32: bool) -> tuple[bool, str]:
    """Whether the `trained` rows of `table` pass the gate against `champion` (a model label of the table, or
    None for the base model), both under `gate.method`, and why, in one line."""
    new = pooled(table, "trained", gate.method)
    label, who = (CHAMPION, f"champion {champion}") if champion else ("base", "the base model")
    bar = pooled(table, label, gate.method)
    solved, bar_solved = _solved(new), _solved(bar)
    accurate = solved >= bar_solved - gate.max_accuracy_drop_problems
    ratios = round_ratios(new, bar)
    measured = len(ratios) >= gate.rounds
    faster = measured and min(ratios) > 1 + gate.min_speedup_gain
    if measured:
        ordered = sorted(ratios)
        speed = (
            f"speed {ordered[len(ordered) // 2]:.3f}x {who}'s (median of {len(ratios)} interleaved rounds, spread "
            f"{ordered[0]:.3f}x-{ordered[-1]:.3f}x; every round must exceed {1 + gate.min_speedup_gain:.3f}x)"
        )
    else:
        speed = (
            f"speed not comparable: the evaluation timed {len(ratios) or 1} round(s) of {gate.method}, the gate "
            f"needs {gate.rounds} (evaluation.decoding.timing_rounds)"
        )
    if not gate.require_exact:
        exact, exact_note = True, "exactness not required"
    elif not float32:
        exact, exact_note = (
            False,
            "exactness unchecked: the evaluation did not run in float32 (evaluate in float32 or set gate.require_exact: false)",
        )
    else:
        exact, exact_note = new["exact"] == 1.0, f"{new['exact']:.0%} of outputs equal greedy"
    allowed = gate.max_repetition_gain
    measured_repetition = "repetition" in new and "repetition" in bar  # not in a table from before the column
    if not measured_repetition:
        fluent = allowed is None
        repetition = (
            "repetition unmeasured (unchecked)"
            if allowed is None
            else "repetition unmeasured: the evaluation predates it (evaluate again, or set "
            "registry.max_repetition_gain: null)"
        )
    else:
        fluent = allowed is None or new["repetition"] - bar["repetition"] <= allowed
        repetition = f"repeated 4-grams {new['repetition']:.1%} vs {bar['repetition']:.1%} " + (
            "(unchecked)" if allowed is None else f"(allowed rise {100 * allowed:.1f} points)"
        )
    failed = [
        what
        for what, ok in (
            ("accuracy fell too far", accurate),
            ("not faster", faster),
            ("not exact", exact),
            ("repeats itself more" if measured_repetition else "repetition unmeasured", fluent),
        )
        if not ok
    ]
    reason = (
        f"{gate.method} vs {who}'s {gate.method}: solved {solved}/{new['samples']} vs {bar_solved}/{bar['samples']} "
        f"(allowed drop {gate.max_accuracy_drop_problems}), {speed}, {_x(new['speedup'])} vs {_x(bar['speedup'])} "
        f"the base model's HF greedy, {exact_note}, {repetition}"
    )
    return not failed, (f"{'; '.join(failed)}: " if failed else "") + reason


def _x(speedup: float | None) -> str:
    return "n/a" if speedup is None else f"{speedup:.2f}x"


def promote(
    tracking: TrackingConfig,
    version: str,
    table: list[dict],
    gate: GateConfig,
    champion: str | None,
    float32: bool,
    log: Callable[[str], None] = print,
) -> RegistryResult:
    """Tag `version` with its figures and the gate's decision, make it the challenger, and the champion if it
    passes against `champion` (the current champion's version, evaluated in `table` as `champion`)."""
    name, mlflow = tracking.registered_model, client(tracking)
    new = pooled(table, "trained", gate.method)
    passed, reason = decide(table, gate, f"v{champion}" if champion else None, float32)
    tags = {
        GATE_FIGURES_TAG + "method": gate.method,
        GATE_FIGURES_TAG + "accuracy": new["accuracy"],
        GATE_FIGURES_TAG + "speedup": new["speedup"],
        GATE_FIGURES_TAG + "tpf": new["tpf"],
        GATE_FIGURES_TAG + "exact": new["exact"],
        GATE_FIGURES_TAG + "repetition": new.get("repetition"),
        GATE_DECISION_TAG: PROMOTED if passed else REJECTED,
        GATE_REASON_TAG: reason,
    }
    for key, value in tags.items():
        mlflow.set_model_version_tag(name, version, key, str(value))
    mlflow.set_registered_model_alias(name, CHALLENGER, version)
    if passed:
        mlflow.set_registered_model_alias(name, CHAMPION, version)
    log(f"gate: {verdict(version, passed, reason)}")
    return RegistryResult(version, passed, reason, version if passed else champion)


def verdict(version: str, passed: bool, reason: str) -> str:
    """The gate's decision on `version` in one line: what the flow log and the gate artifact say."""
    return f"v{version} {f'promoted to {CHAMPION}' if passed else f'stays {CHALLENGER}'}: {reason}"


def champion_version(tracking: TrackingConfig) -> str | None:
    """The registered model's current champion version, if it has one."""
    from mlflow.exceptions import MlflowException

    try:
        return client(tracking).get_model_version_by_alias(tracking.registered_model, CHAMPION).version
    except MlflowException:
        return None


def gate_decision(tracking: TrackingConfig, version: str) -> str | None:
    """What the gate decided for `version`, if it has judged it."""
    return client(tracking).get_model_version(tracking.registered_model, version).tags.get(GATE_DECISION_TAG)


def fetch_version(tracking: TrackingConfig, version: str, cache: Path) -> Path:
    """The HF checkpoint folder of a registered version, downloaded once into `cache`."""
    import mlflow

    folder = cache / f"{tracking.registered_model}-v{version}"
    done = folder / "jf_downloaded.json"
    if not done.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        mlflow.set_tracking_uri(tracking.uri)
        mlflow.artifacts.download_artifacts(f"models:/{tracking.registered_model}/{version}", dst_path=str(folder))
        atomic_write(done, lambda tmp: tmp.write_text(json.dumps({"version": version})))
    [checkpoint] = [p.parent for p in (folder / "artifacts").rglob("config.json")]
    return checkpoint


def current_champion(tracking: TrackingConfig, work_dir: Path) -> Champion | None:
    """The registry's champion, downloaded into work_dir/registry (for retraining from it and for the gate's
    evaluation); None without a registry or a champion."""
    if not tracking.registry:
        return None
    version = champion_version(tracking)
    if version is None:
        return None
    checkpoint = fetch_version(tracking, version, work_dir / REGISTRY)
    return Champion(version, str(checkpoint), f"models:/{tracking.registered_model}/{version}")


@task(name=REGISTRY)
def registry_task(
    tracking: TrackingConfig,
    gate: GateConfig,
    trained: TrainingResult,
    evaluation: EvaluationResult,
    champion: Champion | None,
) -> RegistryResult | None:
    """The stage in a flow: judge the trained version on the evaluation against the champion it was evaluated
    beside (or the base model)."""
    log = get_run_logger()
    if trained.version is None:
        log.warning("stage 'registry' skipped: the training stage registered no model version")
        return None
    rival = champion.version if champion and champion.rivals(trained) else None
    float32 = evaluation.dtypes.get("trained") == "float32"
    result = promote(tracking, trained.version, evaluation.table, gate, rival, float32, log=log.info)
    markdown_artifact(f"**gate**: {verdict(result.version, result.promoted, result.reason)}", GATE_ARTIFACT, "The gate")
    return result
