"""The `jacobi-forcing` flow: base model -> trajectories -> packing -> training -> tuning -> evaluation -> registry.

The flow only chains the stages; each stage task (`tasks/<stage>.py`) owns its
folder under `work_dir`, decides what it can reuse (README, "Reruns and
retraining"), records itself in MLflow, and returns a small typed result:
- trajectories: a store per model and decoding settings; only the prompts it
  does not hold yet are decoded;
- packing: `packing/<digest of the selected trajectories and the settings>`;
- training: `training/<digest of the settings, launch, data and model>`, resumed
  while unfinished and reused once its export verifies; `resume: false` starts a
  new `training/<digest>.<n>` with a new MLflow run;
- tuning: the fastest decoding on this machine of the trained model, and of the
  base model and champion it is judged against, written into each one's
  jacobi_forcing.json (`tuning/<key>` holds the report), reused while the model
  was tuned here with the same settings;
- evaluation: the trained model, the base model and the registry's champion side
  by side on the same problems;
- registry: the gate decides on that one table.
The evaluation stage can also evaluate a learning curve and a float32 check (flows/recipe.py).
When training was reused and its version already judged, the run says "nothing
changed" and registers nothing. One flow run per work_dir at a time: a second
waits for the first (`lock_wait_s`), then refuses. MLflow gets one parent run per
flow run, with the stages' runs nested in it.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from flows.recipe import STAGES, Recipe, Stage, chosen_stages, load_recipe
from jfcore.config import ConfigError, to_dict
from jfcore.contracts import (
    CURVE,
    FLOW_RUN_TAG,
    FP32_CHECK,
    GATE_TAG,
    MODEL_METRICS,
    RECIPE_DIGEST_TAG,
    RECIPE_TAG,
    REGISTERED_VERSION_TAG,
    STAGES_TAG,
    TIMINGS,
    TUNING,
)
from jfcore.lock import folder_lock
from jfcore.models import ModelConfig, ModelLoadError, source_fingerprint
from jfcore.shards import run_key
from tasks.evaluation import EvaluationResult, evaluation_series_task, evaluation_task, headline_method
from tasks.orchestration import flow, get_run_logger, runtime, task
from tasks.packing import PackingResult, packing_task
from tasks.registry import RegistryResult, current_champion, gate_decision, pooled, registry_task
from tasks.tracking import ParentRun, TrackingConfig, models_link, set_model_params
from tasks.training import TrainingResult, training_task
from tasks.trajectories import TrajectoriesResult, trajectories_task
from tasks.tuning import TuningResult, tuning_task

DEFAULT_RECIPE = "configs/pipeline_smollm2_cpu.yaml"


@dataclass(frozen=True)
class StageResults:
    trajectories: TrajectoriesResult
    packing: PackingResult | None  # None: not reached (the flow stopped before it)
    training: TrainingResult | None


@dataclass
class PipelineResult:
    model_fingerprint: str  # the base model's source fingerprint
    stages: dict[str, StageResults] = field(default_factory=dict)  # by curriculum stage (one without a curriculum)
    tuning: TuningResult | None = None  # the trained model's tune
    tunings: dict[str, TuningResult] = field(default_factory=dict)  # by evaluation label: trained, base, champion
    evaluation: EvaluationResult | None = None
    learning_curve: dict[str, EvaluationResult] | None = None  # by curve point (recipe evaluation.learning_curve)
    fp32_check: EvaluationResult | None = None
    registry: RegistryResult | None = None
    nothing_changed: bool = False  # every output reused and the version already judged: nothing registered


@task(name="resolve-model")
def resolve_model_task(model: ModelConfig) -> str:
    """The model's source fingerprint (converting a GGUF preset once); a missing model fails here, before any stage."""
    try:
        return source_fingerprint(model)
    except ModelLoadError as err:
        raise ConfigError(f"recipe model.name_or_path: {err}") from err


# The parameters are typed so that the Prefect UI draws a form for them (the recipe's every section and key, with
# their defaults); our own loader checks what arrives, strictly (an unknown key is an error, not dropped).
@flow(name="jacobi-forcing", log_prints=True, validate_parameters=False)
def jacobi_forcing(
    recipe: Recipe | str = DEFAULT_RECIPE,
    stages: list[Stage] | None = None,
    resume: bool = True,
    curriculum: list[str] | None = None,
) -> PipelineResult:
    """Run the pipeline a recipe describes.

    recipe: a YAML/JSON path (relative to the working folder) or the recipe's values.
    stages: which stages to run (default: all, in order); a skipped stage's output must already exist.
    resume: continue unfinished training runs; false starts new ones (new folders, new MLflow runs).
    curriculum: run trajectories, packing and training for these curriculum stages only (default: all); the
        stages before them hand on what they wrote, the ones after are left alone.
    """
    config, chosen = load_recipe(recipe), chosen_stages(stages)  # a malformed recipe fails here, before any stage
    selected = chosen_curriculum(config, curriculum)
    result = PipelineResult(resolve_model_task(config.model))
    holder = f"flow run {runtime.flow_run.name or '?'} ({runtime.flow_run.id or 'no id'})"
    source = recipe if isinstance(recipe, str) else "(given as values)"
    tags = {
        FLOW_RUN_TAG: str(runtime.flow_run.id or ""),
        STAGES_TAG: ",".join(chosen),
        RECIPE_TAG: source,
        RECIPE_DIGEST_TAG: run_key(recipe=to_dict(config)),
    }
    # Readable in the runs table: the model, what ran, and the Prefect flow run it was.
    what = "full pipeline" if list(chosen) == list(STAGES) else "+".join(chosen)
    name = config.tracking.run_name or f"{Path(config.model.name_or_path).name}: {what} ({runtime.flow_run.name})"
    with (
        folder_lock(config.path(""), holder, config.lock_wait_s, get_run_logger().info),
        ParentRun(config.tracking, name, {"recipe": to_dict(config)}, tags) as parent,
    ):
        _chain(config, chosen, selected, resume, parent.tracking, result)
        _summarize(parent, tags, result)
    return result


def _summarize(parent: ParentRun, tags: dict[str, str], result: PipelineResult) -> None:
    """The parent run's headline: the trained and the base model's pooled figures under the evaluation's headline
    method, the registered version and the gate's decision as tags, and a description that says what happened
    and links the experiment's Models tab, where every evaluated checkpoint compares side by side."""
    tracking, log = parent.tracking, get_run_logger().info
    lines, metrics, summary = [f"**{parent.name}**", f"recipe `{tags[RECIPE_TAG]}`"], {}, {}
    trained = list(result.stages.values())[-1].training if result.stages else None
    if trained and trained.model:
        model = trained.model
        lines.append(f"trained model: {model['model_uri']}")
        if model.get("registered_model"):
            summary[REGISTERED_VERSION_TAG] = f"{model['registered_model']} v{model['version']}"
            lines[-1] += f" ({summary[REGISTERED_VERSION_TAG]})"
        model_id = model["model_uri"].removeprefix("models:/")
        set_model_params(tracking, model_id, {"recipe_digest": tags[RECIPE_DIGEST_TAG]})
    if result.registry:
        summary[GATE_TAG] = "promoted" if result.registry.promoted else "rejected"
        lines.append(f"gate: {summary[GATE_TAG]}: {result.registry.reason}")
    if result.nothing_changed:
        lines.append("nothing changed: every output reused, the version already judged")
    if result.evaluation:
        method = headline_method(tuple({r["method"] for r in result.evaluation.table}))
        for label in ("trained", "base"):
            row = pooled(result.evaluation.table, label, method)
            metrics |= {
                f"{label}/{name}": row[column] for name, column in MODEL_METRICS.items() if row[column] is not None
            }
        lines.append(f"pooled figures under `{method}` decoding; per benchmark and method:")
        lines.append(result.evaluation.markdown)
    if link := models_link(tracking):
        lines.insert(2, f"[compare the checkpoints side by side]({link})")
        log(f"compare checkpoints in MLflow: {link}")
    parent.summarize("\n\n".join(lines), metrics, summary)


def chosen_curriculum(config: Recipe, names: list[str] | None) -> list[str]:
    """The curriculum stages to run (default all); an unknown name is an error."""
    known = [plan.name for plan in config.stages()]
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ConfigError(f"curriculum: unknown stage {unknown[0]!r}; the recipe's stages are {', '.join(known)}")
    return [name for name in known if name in (names or known)]


@contextmanager
def _timed(config: Recipe, stage: str, ran: bool = True):
    """Append the stage's seconds to work_dir/timings.jsonl (throughput figures in bench.campaign_report), when
    it `ran` rather than handed on an earlier output. The body may set the yielded record's "output" (the folder
    it wrote), so a report counts the seconds of the output it reports and not those of a rerun with other
    settings under the same stage name."""
    began, record = time.perf_counter(), {"stage": stage}
    yield record
    if not ran:
        return
    if "output" in record:
        record["output"] = str(Path(record["output"]).resolve())
    record |= {"seconds": time.perf_counter() - began, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(config.path(TIMINGS), "a") as file:
        file.write(json.dumps(record) + "\n")


def _chain(
    config: Recipe,
    chosen: list[Stage],
    selected: list[str],
    resume: bool,
    tracking: TrackingConfig,
    result: PipelineResult,
):
    log = get_run_logger()
    champion = current_champion(tracking, config.path(""))
    model = config.model
    if config.retrain_from == "champion" and "training" in chosen:
        model = replace(config.model, name_or_path=champion.checkpoint, gguf_file=None) if champion else model
        start = f"{tracking.registered_model} v{champion.version}" if champion else "the base model (no champion yet)"
        log.info(f"retrain_from champion: training starts from {start}")
    plans = config.stages()
    # A stage past the last one chosen is not called, so `stages: [trajectories]` decodes and stops; a curriculum
    # stage after the last selected one is left alone, and everything after training needs every curriculum stage.
    last = max(STAGES.index(stage) for stage in chosen)
    upto = max(i for i, plan in enumerate(plans) if plan.name in selected)
    whole = upto == len(plans) - 1
    for i, plan in enumerate(plans[: upto + 1]):
        plan = plan.starting_from(model)  # the champion, or a curriculum stage's previous export
        # Only the last stage's model is registered; earlier ones are logged in their runs.
        registered = tracking if i == len(plans) - 1 else replace(tracking, registered_model=None)

        def runs(stage: str, plan=plan) -> bool:
            return stage in chosen and plan.name in selected

        def needed(stage: str, i=i) -> bool:  # a later curriculum stage starts from this one's trained model
            return i < upto or STAGES.index(stage) <= last

        where = f"/{plan.name}" if plan.label else ""
        with _timed(config, f"trajectories{where}", runs("trajectories")) as timing:
            anchor = result.stages[plan.anchor].trajectories.selection if plan.anchor else None
            trajectories = trajectories_task(
                plan, config.ray, config.prompts_per_shard, registered, runs("trajectories"), anchor
            )
            timing["output"] = trajectories.read().store
        packing = trained = None
        if needed("packing"):
            with _timed(config, f"packing{where}", runs("packing")) as timing:
                packing = packing_task(plan, trajectories.selection, registered, runs("packing"))
                timing["output"] = packing.folder
        if needed("training"):
            with _timed(config, f"training{where}", runs("training")) as timing:
                trained = training_task(plan, packing.folder, config.launch, registered, runs("training"), resume)
                timing["output"] = trained.folder
            model = replace(config.model, name_or_path=trained.final, gguf_file=None)
        result.stages[plan.name] = StageResults(trajectories, packing, trained)
    if last <= STAGES.index("training"):
        return
    if not whole:
        later = [s for s in chosen if STAGES.index(s) > STAGES.index("training")]
        log.info(f"{', '.join(later)}: not run, they need every curriculum stage (chosen: {', '.join(selected)})")
        return

    reused = "training" in chosen and all(s.training.reused for s in result.stages.values())
    if tracking.registry and reused and trained.version and (decision := gate_decision(tracking, trained.version)):
        log.info(f"nothing changed: every output is reused and v{trained.version} was already judged ({decision})")
        result.nothing_changed = True
        return
    if "tuning" in chosen:
        # The trained model, and the models the gate compares it with under their own tunes: the base model and
        # the champion (each reused while tuned on this machine with these settings).
        # The bars' tunes are logged in their report folders; MLflow's `tuning` run is the trained model's.
        e, rival = config.evaluation, champion.rivals(trained) if champion else None
        jobs = {
            "trained": (model, (trained.model or {}).get("model_uri"), tracking),
            "base": (config.model, None, None),
        }
        if rival:
            jobs["champion"] = (replace(config.model, name_or_path=rival[0], gguf_file=None), None, None)
        with _timed(config, "tuning"):
            for label, (tuned_model, model_uri, logged) in jobs.items():
                result.tunings[label] = tuning_task.with_options(name=f"{TUNING}-{label}")(
                    tuned_model,
                    config.tuning,
                    str(config.path(TUNING)),
                    e.benchmarks,
                    e.data_dir,
                    logged,
                    model_uri,
                    config.ray.cpus_per_worker,  # the evaluation workers' threads: the tune must hold where it is used
                )
        result.tuning = result.tunings["trained"]
    if "evaluation" in chosen:
        _evaluate(config, trained, champion, tracking, result)
        if "registry" in chosen and tracking.registry and result.evaluation:
            result.registry = registry_task(tracking, config.registry, trained, result.evaluation, champion)


def _evaluate(config: Recipe, trained: TrainingResult, champion, tracking: TrackingConfig, result: PipelineResult):
    """The side-by-side evaluation, then the learning curve and the float32 check where the recipe asks."""
    e = config.evaluation
    if e.base_vs_trained:
        rival = champion.rivals(trained) if champion else None
        evaluation = config.eval_config(trained.final, (trained.model or {}).get("model_uri"), rival)
        with _timed(config, "evaluation"):
            result.evaluation = evaluation_task(evaluation, config.ray, tracking)
    if e.learning_curve:
        with _timed(config, CURVE):
            series = evaluation_series_task.with_options(name=CURVE)
            result.learning_curve = series(CURVE, config.curve_configs(), config.ray, tracking)
    if e.fp32_check:
        with _timed(config, FP32_CHECK):
            series = evaluation_series_task.with_options(name=FP32_CHECK)
            checks = series(FP32_CHECK, {"trained-fp32": config.fp32_config(trained.final)}, config.ray, tracking)
            result.fp32_check = checks["trained-fp32"]
