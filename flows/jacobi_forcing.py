"""The `jacobi-forcing` flow: base model -> trajectories -> packing -> distillation -> evaluation -> registry.

Every stage writes into a folder named by what determines its output, and a
rerun reuses what still verifies (README, "Reruns and retraining"):
- trajectories: a store per model and decoding settings; only the prompts it
  does not hold yet are decoded;
- packing: `packed/<digest of the selected trajectories and the settings>`,
  reused while its files verify;
- training: `train/<digest of the training settings, launch, packed data and
  model>`: resumed from its newest checkpoint while unfinished, reused once its
  export verifies. `resume: false` starts `train/<digest>.<n>` afresh, with a
  new MLflow run. `train/latest` names the newest;
- evaluation: the trained model, the base model and the registry's champion
  side by side on the same problems; the gate decides on that one table.
When training was reused and its version already judged, the run says
"nothing changed" and registers nothing. One flow run per work_dir at a time: a
second waits for the first (`lock_wait_s`), then refuses.
MLflow gets one parent run per flow run, with the stages' runs nested in it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger, runtime, task

from flows.recipe import STAGES, Recipe, Stage, StagePlan, load_recipe
from jfcore.atomic import atomic_write
from jfcore.config import ConfigError, from_dict, replace_checked, to_dict
from jfcore.lock import folder_lock
from jfcore.models import ModelConfig, ModelLoadError, resolve_checkpoint, source_fingerprint
from jfcore.shards import file_sha256, run_key
from jfcore.training.checkpoints import FINAL
from tasks.evaluation import evaluate_task
from tasks.packing import pack_trajectories_task, packed_problem
from tasks.registry import champion_version, fetch_version, gate_decision, register_task
from tasks.tracking import TrackingConfig, client, logged_model, new_run, record_stage
from tasks.training import LaunchConfig, load_deepspeed_config, train_task
from tasks.trajectories import SETS, generate_trajectories_task

DEFAULT_RECIPE = "configs/pipeline_smollm2_cpu.yaml"
LATEST = "latest"  # in a stage's train/ folder: a link to the newest training run
EXPORT_SUMS = "export.json"  # in a training run's folder: checksums of its final export


@task(name="resolve-model")
def resolve_model_task(model: dict) -> str:
    """The model's source fingerprint (converting a GGUF preset once): what names the stages' folders."""
    return source_fingerprint(from_dict(ModelConfig, model, "model"))


# The parameters are typed so that the Prefect UI draws a form for them (the recipe's every section and key, with
# their defaults); our own loader checks what arrives, strictly (an unknown key is an error, not dropped).
@flow(name="jacobi-forcing", log_prints=True, validate_parameters=False)
def jacobi_forcing(
    recipe: Recipe | str = DEFAULT_RECIPE, stages: list[Stage] | None = None, resume: bool = True
) -> dict:
    """Run the pipeline a recipe describes.

    recipe: a YAML/JSON path (relative to the working folder) or the recipe's values.
    stages: which stages to run (default: all, in order); a skipped stage's output must already exist.
    resume: continue unfinished training runs; false starts new ones (new folders, new MLflow runs).
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
    holder = f"flow run {runtime.flow_run.name or '?'} ({runtime.flow_run.id or 'no id'})"
    with folder_lock(config.path(""), holder, config.lock_wait_s, log.info):
        parent = _parent_run(config, chosen)
        # the recipe's run_name names the parent; the nested runs are named by their stage
        tracking = replace_checked(config.tracking, parent_run_id=parent, run_name=None) if parent else config.tracking
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
    registry = bool(tracking.uri and tracking.registered_model)
    champion = champion_version(tracking) if registry else None
    # downloaded once into work_dir/registry, for retraining from it and for the gate's evaluation
    champion_dir = str(fetch_version(tracking, champion, config.path("registry"))) if champion else None
    start = config.model
    if config.retrain_from == "champion" and "train" in chosen:
        if champion:
            start = replace_checked(config.model, name_or_path=champion_dir, gguf_file=None)
            log.info(f"retrain_from champion: training starts from {tracking.registered_model} v{champion}")
        else:
            log.info("retrain_from champion: the registry has no champion yet; training starts from the base model")
    base = resolve_model_task(asdict(config.model))
    log.info(f"model {config.model.name_or_path}: fingerprint {base}")
    result: dict = {"model_fingerprint": base}
    plans, model, outcome = config.stages(), start, {}
    for i, plan in enumerate(plans):
        plan = dataclasses.replace(plan, model=model)  # a curriculum stage starts from the previous stage's export
        # Only the last stage's model is registered; earlier ones are logged in their runs.
        stage_tracking = tracking if i == len(plans) - 1 else replace_checked(tracking, registered_model=None)
        outcome = _run_stage(config, plan, chosen, resume, stage_tracking, log)
        result |= outcome if not config.curriculum else {}
        result.setdefault("stages", {})[plan.name] = outcome
        model = replace_checked(config.model, name_or_path=str(Path(outcome["train_dir"]) / FINAL), gguf_file=None)

    final, logged = model.name_or_path, outcome.get("model") or {}
    if (
        registry
        and "train" in chosen
        and logged.get("version")
        and all(s.get("reused") for s in result["stages"].values())
    ):
        decision = gate_decision(tracking, str(logged["version"]))
        if decision:
            log.info(
                f"nothing changed: every stage's output is reused and {tracking.registered_model} "
                f"v{logged['version']} was already judged ({decision}); no new version"
            )
            return result | {"nothing_changed": True}
    if "evaluate" in chosen:
        rival = None
        if champion and champion != str(logged.get("version")):
            rival = (champion_dir, f"models:/{tracking.registered_model}/{champion}")
        evaluation = config.eval_config(final, logged.get("model_uri"), rival)
        result["evaluation"] = evaluate_task(to_dict(evaluation), asdict(config.ray), to_dict(tracking))
        if "register" in chosen and registry:
            if logged.get("version") is None:
                log.warning("stage 'register' skipped: the training stage registered no model version")
            else:
                float32 = evaluation.models["trained"].model.dtype == "float32"
                result["registry"] = register_task(
                    to_dict(tracking),
                    str(logged["version"]),
                    result["evaluation"]["table"],
                    asdict(config.gate),
                    champion if rival else None,
                    float32,
                )
    return result


def _run_stage(config: Recipe, plan: StagePlan, chosen: list[str], resume: bool, tracking: TrackingConfig, log) -> dict:
    """Trajectories, packing and training of one (curriculum) stage; reuses every output that verifies."""
    if config.curriculum:
        log.info(
            f"curriculum stage {plan.name}: block size {plan.trajectory.block_size}, window "
            f"{plan.packing.window}, from {plan.model.name_or_path}"
        )
    anchor = resolve_model_task(asdict(plan.model))
    result: dict = {}
    if "trajectories" in chosen:  # cheap when nothing is new: the store answers without starting a worker
        selection = generate_trajectories_task(
            asdict(plan.model),
            asdict(plan.prompts),
            asdict(plan.trajectory),
            asdict(config.ray),
            str(plan.path("trajectories")),
            config.prompts_per_shard,
        )
    else:
        selection = _newest(plan.path("trajectories").glob(f"*/{SETS}/*.json"), "trajectories", plan)
    result["trajectories"] = selection
    chosen_set = json.loads(Path(selection).read_text())
    packed = plan.path("packed") / run_key(
        store=chosen_set["store"], shards=chosen_set["shards"], packing=asdict(plan.packing)
    )
    problem = packed_problem(packed)
    if problem is None:
        log.info(f"packing: reused {packed} (complete; its files verify)")
    elif "packing" in chosen:
        log.info(f"packing: {problem}; packing")
        result["packing"] = pack_trajectories_task(selection, str(packed), asdict(plan.packing))
    else:
        raise ConfigError(f"stage 'packing' skipped, but {problem}; include 'packing'")
    result["packed"] = str(packed)
    if tracking.uri:
        _record_data_stages(config, plan, chosen, tracking, selection, packed)

    # resume: a new folder has nothing to resume, and a reused one continues
    train = to_dict(replace_checked(config.train_config(plan, str(packed)), resume=True))
    if "train" not in chosen:
        folder = (plan.path("train") / LATEST).resolve()
        if not (folder / FINAL / "config.json").is_file():
            raise ConfigError(
                f"stage 'train' skipped, but there is no trained model at {folder / FINAL}; include 'train'"
            )
        return result | {"train_dir": str(folder), "model": logged_model(folder), "reused": True}
    folder = _train_folder(plan, train, config.launch, anchor, resume)
    _point_latest(folder)
    train["output_dir"] = str(folder)
    problem = _export_problem(folder)
    logged = logged_model(folder)
    if problem is None and (logged or not tracking.uri):
        log.info(f"training: reused {folder} (finished; its export verifies)")
        return result | {"train_dir": str(folder), "model": logged, "reused": True}
    if problem and (folder / FINAL).exists():
        log.warning(f"training: {problem}; exporting again from the newest checkpoint")
        shutil.rmtree(folder / FINAL)
    log.info(f"training into {folder}")
    result["train"] = train_task(train, to_dict(config.launch), to_dict(tracking))
    _write_export_sums(folder)
    return result | {"train_dir": str(folder), "model": result["train"].get("model"), "reused": False}


def _train_folder(plan: StagePlan, train: dict, launch: LaunchConfig, model_fingerprint: str, resume: bool) -> Path:
    """`train/<key>` for these settings: the newest such run when resuming, a new `<key>.<n>` otherwise."""
    identity = {k: v for k, v in train.items() if k not in ("output_dir", "resume")}
    key = run_key(
        train=identity,
        model=model_fingerprint,
        processes=launch.processes,
        deepspeed=load_deepspeed_config(launch.deepspeed_config),
    )
    root = plan.path("train")
    runs = sorted(
        (int(m.group(1) or 1), p) for p in root.glob(f"{key}*") if (m := re.fullmatch(rf"{key}(?:\.(\d+))?", p.name))
    )
    if runs and (resume or not any(runs[-1][1].iterdir())):
        return runs[-1][1]
    n = runs[-1][0] + 1 if runs else 1
    return root / (key if n == 1 else f"{key}.{n}")


def _point_latest(folder: Path) -> None:
    """train/latest -> folder, replaced atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder.parent / LATEST
    tmp = folder.parent / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(folder.name)
    os.replace(tmp, link)


def _export_problem(folder: Path) -> str | None:
    """Why `folder`'s final export cannot be reused (None when it can): missing, or not what was exported."""
    final, sums = folder / FINAL, folder / EXPORT_SUMS
    if not (final / "config.json").is_file() or not sums.is_file():
        return f"{folder} has no finished export"
    recorded = json.loads(sums.read_text())
    present = {p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()}
    changed = [name for name, digest in recorded.items() if name not in present or file_sha256(final / name) != digest]
    return f"the export in {final} changed since training ({', '.join(sorted(changed))})" if changed else None


def _write_export_sums(folder: Path) -> None:
    final = folder / FINAL
    sums = {p.relative_to(final).as_posix(): file_sha256(p) for p in sorted(final.rglob("*")) if p.is_file()}
    atomic_write(folder / EXPORT_SUMS, lambda tmp: tmp.write_text(json.dumps(sums, indent=1)))


def _newest(paths, stage: str, plan: StagePlan) -> str:
    found = list(paths)
    if not found:
        raise ConfigError(f"stage {stage!r} skipped, but {plan.path(stage)} holds no finished run; include {stage!r}")
    return str(max(found, key=lambda p: p.stat().st_mtime))


def _record_data_stages(
    config: Recipe, plan: StagePlan, chosen: list[str], tracking: TrackingConfig, selection: str, packed: Path
) -> None:
    """The data stages' settings, figures and outputs as runs nested under the flow's run."""
    suffix = f" ({plan.name})" if config.curriculum else ""
    if "trajectories" in chosen:
        chosen_set = json.loads(Path(selection).read_text())
        record_stage(
            tracking,
            "trajectories" + suffix,
            {
                "model": asdict(plan.model),
                "prompts": asdict(plan.prompts),
                "trajectory": asdict(plan.trajectory),
                "ray": asdict(config.ray),
                "store": chosen_set["store"],
            },
            {
                "prompts": chosen_set["num_prompts"],
                "skipped_too_long": chosen_set["skipped_too_long"],
                "reused_prompts": chosen_set["reused"],
                "decoded_prompts": chosen_set["decoded"],
                "shards": len(chosen_set["shards"]),
            },
            [Path(selection)],
        )
    if "packing" in chosen:
        stats = json.loads((packed / "stats.json").read_text())
        figures = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        record_stage(
            tracking,
            "packing" + suffix,
            {"packing": asdict(plan.packing), "trajectories": selection, "folder": str(packed)},
            figures,
            [packed / "stats.json"],
        )


def _parent_run(config: Recipe, chosen: list[str]) -> str | None:
    """One MLflow run per flow run; the stages' runs nest under it."""
    if not config.tracking.uri:
        return None
    tags = {"jacobi_forcing.flow_run_id": str(runtime.flow_run.id or ""), "jacobi_forcing.stages": ",".join(chosen)}
    name = config.tracking.run_name or runtime.flow_run.name or "jacobi-forcing"
    return new_run(config.tracking, name, {"recipe": to_dict(config)}, tags)
