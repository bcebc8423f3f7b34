"""The `jacobi-forcing` flow: base model -> trajectories -> packing -> distillation -> evaluation -> registry.

Each stage is a Prefect task whose output folder is named by its inputs, so a
rerun finishes what a killed run left. On top of that, the data stages carry
Prefect cache keys over their inputs and the model's fingerprint: an unchanged
stage is not run again (the log says `Cached`), and a flow run killed during
training resumes from the newest checkpoint when it is run again.
MLflow gets one parent run per flow run, with the stages' runs nested in it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger, runtime, task

from flows.recipe import STAGES, Recipe, StagePlan, load_recipe
from jfcore.config import ConfigError, from_dict, replace, to_dict
from jfcore.models import ModelConfig, ModelLoadError, resolve_checkpoint, source_fingerprint
from jfcore.shards import MANIFEST, run_key
from jfcore.training.loop import FINAL
from tasks.evaluation import evaluate_task
from tasks.packing import pack_trajectories_task
from tasks.registry import register_task
from tasks.tracking import TrackingConfig, client, new_run, record_stage
from tasks.training import train_task
from tasks.trajectories import generate_trajectories_task

DEFAULT_RECIPE = "configs/pipeline_smollm2_cpu.yaml"


def _cached(stage, resume: bool, *anchors: str):
    """`stage` with a Prefect cache key over its inputs and what they name but do not show (model weights,
    a prompt file's content): an unchanged stage is a cache hit, a changed anchor a miss."""

    def key(context, parameters: dict) -> str:
        # Where results are logged is not what they are: a new flow run's parent MLflow run still hits.
        values = {k: v for k, v in parameters.items() if k != "tracking"}
        return run_key(task=context.task.name, anchors=anchors, parameters=values)

    return stage.with_options(cache_key_fn=key, persist_result=True, refresh_cache=not resume)


def _stamp(path: str) -> str:
    """Size and modification time of a local file or folder's files; the path itself otherwise."""
    files = [Path(path)] if Path(path).is_file() else sorted(p for p in Path(path).rglob("*") if p.is_file())
    return run_key(path=path, files=[(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files])


@task(name="resolve-model")
def resolve_model_task(model: dict) -> str:
    """The model's source fingerprint (converting a GGUF preset once): the cache keys' anchor."""
    return source_fingerprint(from_dict(ModelConfig, model, "model"))


@flow(name="jacobi-forcing", log_prints=True)
def jacobi_forcing(recipe: str | dict = DEFAULT_RECIPE, stages: list[str] | None = None, resume: bool = True) -> dict:
    """Run the pipeline a recipe describes.

    recipe: a YAML/JSON path (relative to the working folder) or the recipe's values.
    stages: which stages to run (default: all, in order); a skipped stage's output must already exist.
    resume: reuse cached stages and training checkpoints; false recomputes everything.
    """
    log = get_run_logger()
    config = load_recipe(recipe)  # a malformed recipe fails here, before any stage
    chosen = list(stages or STAGES)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ConfigError(f"stages: unknown {unknown}; choose from {list(STAGES)}")
    try:  # a missing model fails here too, before any stage (a preset is converted once)
        resolve_checkpoint(config.model)
    except ModelLoadError as err:
        raise ConfigError(f"recipe model.name_or_path: {err}") from err
    parent = _parent_run(config, chosen)
    # the recipe's run_name names the parent; the nested runs are named by their stage
    tracking = replace(config.tracking, parent_run_id=parent, run_name=None) if parent else config.tracking
    try:
        result = _run_stages(config, chosen, resume, tracking, log)
    except BaseException:
        if parent:
            client(config.tracking).set_terminated(parent, "FAILED")
        raise
    if parent:
        mlflow = client(config.tracking)
        if "evaluation" in result:
            mlflow.set_tag(parent, "mlflow.note.content", result["evaluation"]["markdown"])
        mlflow.set_terminated(parent, "FINISHED")
    return result


def _run_stages(config: Recipe, chosen: list[str], resume: bool, tracking: TrackingConfig, log) -> dict:
    base = resolve_model_task(asdict(config.model))
    log.info(f"model {config.model.name_or_path}: fingerprint {base}")
    result: dict = {"model_fingerprint": base}
    plans = config.stages()
    logged: dict = {}
    for i, plan in enumerate(plans):
        last = i == len(plans) - 1
        # A curriculum stage starts from the previous stage's export: its fingerprint anchors the caches.
        anchor = base if i == 0 else resolve_model_task(asdict(plan.model))
        # Only the last stage's model is registered; earlier ones are logged in their runs.
        stage_tracking = tracking if last else replace(tracking, registered_model=None)
        outcome = _run_stage(config, plan, chosen, resume, stage_tracking, anchor, log)
        result |= outcome if not config.curriculum else {}
        result.setdefault("stages", {})[plan.name] = outcome
        logged = (outcome.get("train") or {}).get("model") or {}

    final = config.final_model()
    if "evaluate" in chosen:
        trained = resolve_model_task(asdict(config.eval_config(final).models["trained"].model))
        evaluation = to_dict(config.eval_config(final, logged.get("model_uri")))
        result["evaluation"] = _cached(evaluate_task, resume, base, trained)(
            evaluation, asdict(config.ray), to_dict(tracking)
        )
    if "register" in chosen and "evaluation" in result and tracking.uri and tracking.registered_model:
        if logged.get("version") is None:
            log.warning("stage 'register' skipped: the training stage registered no model version this run")
        else:
            result["registry"] = register_task(to_dict(tracking), str(logged["version"]),
                                               result["evaluation"]["table"], asdict(config.gate))  # fmt: skip
    return result


def _run_stage(config: Recipe, plan: StagePlan, chosen: list[str], resume: bool, tracking: TrackingConfig,
               anchor: str, log) -> dict:  # fmt: skip
    """Trajectories, packing and training of one (curriculum) stage."""
    if config.curriculum:
        log.info(f"curriculum stage {plan.name}: block size {plan.trajectory.block_size}, window "
                 f"{plan.packing.window}, from {plan.model.name_or_path}")  # fmt: skip
    result: dict = {}
    trajectories = _existing(plan.path("trajectories"), "trajectories", chosen)
    if "trajectories" in chosen:
        trajectories = _cached(generate_trajectories_task, resume, anchor, _stamp(plan.prompts.path))(
            asdict(plan.model), asdict(plan.prompts), asdict(plan.trajectory), asdict(config.ray),
            str(plan.path("trajectories")), config.prompts_per_shard,
        )  # fmt: skip
    result["trajectories"] = trajectories

    packed = str(plan.path("packed"))
    if "packing" in chosen:
        result["packing"] = _cached(pack_trajectories_task, resume, anchor)(trajectories, packed, asdict(plan.packing))
    if tracking.uri:
        _record_data_stages(config, plan, chosen, tracking, trajectories, packed)
    train = to_dict(replace(config.train_config(plan, packed), resume=resume))
    final = Path(train["output_dir"]) / FINAL
    if "train" in chosen:  # a finished training is a cache hit; a killed one resumes from its checkpoint
        result["train"] = _cached(train_task, resume, anchor, _stamp(packed))(train, to_dict(config.launch),
                                                                               to_dict(tracking))  # fmt: skip
    elif not final.is_dir():
        raise ConfigError(f"stage 'train' skipped, but there is no trained model at {final}; include 'train'")
    return result


def _record_data_stages(config: Recipe, plan: StagePlan, chosen: list[str], tracking: TrackingConfig,
                        trajectories: str, packed: str) -> None:  # fmt: skip
    """The data stages' settings, figures and manifests as runs nested under the flow's run."""
    suffix = f" ({plan.name})" if config.curriculum else ""
    if "trajectories" in chosen:
        manifest = json.loads((Path(trajectories) / MANIFEST).read_text())
        rows = sum(shard["rows"] for shard in manifest["shards"].values())
        record_stage(tracking, "trajectories" + suffix, {"model": asdict(plan.model), "prompts": asdict(plan.prompts),
                     "trajectory": asdict(plan.trajectory), "ray": asdict(config.ray), "folder": trajectories},
                     {"prompts": manifest["num_prompts"], "skipped_too_long": manifest["skipped_too_long"],
                      "shards": len(manifest["shards"]), "blocks": rows}, [Path(trajectories) / MANIFEST])  # fmt: skip
    if "packing" in chosen:
        stats = json.loads((Path(packed) / "stats.json").read_text())
        figures = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        record_stage(tracking, "packing" + suffix, {"packing": asdict(plan.packing), "trajectories": trajectories},
                     figures, [Path(packed) / "stats.json"])  # fmt: skip


def _existing(folder: Path, stage: str, chosen: list[str]) -> str:
    """A skipped data stage's newest finished output."""
    if stage in chosen:
        return ""
    done = [p.parent for p in folder.glob("*/manifest.json") if json.loads(p.read_text()).get("complete")]
    if not done:
        raise ConfigError(f"stage {stage!r} skipped, but {folder} holds no finished run; include {stage!r}")
    return str(max(done, key=lambda p: p.stat().st_mtime))


def _parent_run(config: Recipe, chosen: list[str]) -> str | None:
    """One MLflow run per flow run; the stages' runs nest under it."""
    if not config.tracking.uri:
        return None
    tags = {"jacobi_forcing.flow_run_id": str(runtime.flow_run.id or ""), "jacobi_forcing.stages": ",".join(chosen)}
    name = config.tracking.run_name or runtime.flow_run.name or "jacobi-forcing"
    return new_run(config.tracking, name, {"recipe": to_dict(config)}, tags)
