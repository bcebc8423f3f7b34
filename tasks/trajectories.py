"""Trajectory generation: Ray actors, one model replica each, write Parquet shards into a trajectory store.

A store is a folder named by everything that determines a prompt's trajectory
but the prompt: the model's source fingerprint, the tokenizer and the decoding
settings. Each shard's manifest entry lists the prompts it holds (by a digest of
id and token ids), so a rerun decodes only the prompts no verified shard holds:
appended prompts cost only themselves, an unchanged prompt set starts no worker.
Shards are spread over the workers and added to the manifest as they land: a
killed worker is restarted by Ray and its shard redone; a killed run loses only
the shards in flight. The stage's output is a selection file in the store
(`sets/<prompt set fingerprint>.json`, a jfcore.contracts.Selection): which shard
holds which prompt of this set.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from jfcore.config import ConfigError, from_dict
from jfcore.contracts import SETS, TRAJECTORIES, Selection
from jfcore.models import (
    ModelConfig,
    load_model,
    load_tokenizer,
    model_fingerprint,
    source_fingerprint,
    tokenizer_fingerprint,
)
from jfcore.prompts import BUILTIN, PromptSet, PromptSource, builtin_prompts_path, encode_prompts
from jfcore.shards import ShardSpec, drop_unverified, plan_shards, read_manifest, run_key, write_shard
from jfcore.trajectories import TrajectoryConfig, anchored_trajectories, decode_trajectories, responses
from tasks.orchestration import Progress, get_run_logger, progress_artifact, task
from tasks.plan import StagePlan
from tasks.ray_workers import RayConfig, fill_shards, get, ray_session, start_workers
from tasks.tracking import DataInput, TrackingConfig, record_stage


class TrajectoryWorker:
    """Holds one model replica and turns prompt shards into trajectory shards."""

    def __init__(self, model_config: dict, trajectory_config: dict, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.model, tokenizer = load_model(from_dict(ModelConfig, model_config))
        self.config = from_dict(TrajectoryConfig, trajectory_config)
        self.model_fp = model_fingerprint(self.model)
        self.tokenizer_fp = tokenizer_fingerprint(tokenizer)

    def fingerprints(self) -> tuple[str, str]:
        return self.model_fp, self.tokenizer_fp

    def pid(self) -> int:
        return os.getpid()

    def run(
        self,
        spec: ShardSpec,
        ids: list[str],
        prompts: list[list[int]],
        keys: list[str],
        folder: str,
        references: list[list[int]] | None = None,  # an anchored round's reference responses, one per prompt
    ):
        fingerprints = self.model_fp, self.tokenizer_fp
        if references is None:
            table = decode_trajectories(self.model, ids, prompts, self.config, *fingerprints)
        else:
            table = anchored_trajectories(self.model, ids, prompts, references, self.config, *fingerprints)
        return write_shard(table, Path(folder), spec, len(prompts), tuple(keys))


@dataclass(frozen=True)
class TrajectoriesResult:
    selection: str  # the selection file: the stage's output
    ran: bool  # False: the stage was skipped and an earlier run's selection is used

    def read(self) -> Selection:
        return Selection.read(self.selection)


def generate_trajectories(
    model: ModelConfig,
    prompts: PromptSource,
    trajectory: TrajectoryConfig,
    ray_config: RayConfig,
    out_dir: str | Path,
    prompts_per_shard: int = 64,
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
    anchor: str | Path | None = None,
) -> Path:
    """Decode the prompts the store does not hold yet; returns the prompt set's selection file.

    With `anchor` (another trajectory stage's selection file, decoded on the same prompts), the model does not
    write its own text: its Jacobi iterates run on each block of the anchor's responses, which are the fixed
    points (jfcore/teacher_forced.py)."""
    tokenizer = load_tokenizer(model)
    prompt_set = encode_prompts(prompts, tokenizer)
    if not prompt_set.ids:
        raise ValueError(f"no usable prompts in {prompts.path} ({prompt_set.skipped_too_long} longer than the budget)")
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    # How forwards run (compile) changes no token: stores made either way are the same store.
    settings = {k: v for k, v in asdict(trajectory).items() if k != "compile"}
    key = {"model": source_fingerprint(model), "tokenizer": tokenizer_fp, "trajectory": settings}
    references = None
    if anchor:
        chosen = Selection.read(anchor)
        references = _references(chosen, Path(anchor), prompt_set, tokenizer_fp)
        key["anchor"] = Path(chosen.store).name
        log(f"anchored: fixed points from {anchor}, the model's own iterates on them")
    store = Path(out_dir) / run_key(**key)
    keys = prompt_set.keys()
    # a shard whose file is gone or damaged is forgotten, so its prompts count as new
    held = {key: name for name, record in drop_unverified(store).items() for key in record.keys}
    todo = [i for i, key in enumerate(keys) if key not in held]
    log(
        f"{len(keys)} prompts ({prompt_set.skipped_too_long} skipped: over {prompts.max_prompt_tokens} tokens): "
        f"{len(keys) - len(todo)} already decoded with this model and settings (reused), {len(todo)} to decode; "
        f"store {store}"
    )
    if todo:
        job = _Job(model, trajectory, store, prompt_set, keys, todo, tokenizer_fp, references)
        with ray_session(ray_config):
            held |= _decode(job, ray_config, prompts_per_shard, log, progress)
    return _write_selection(store, prompt_set, keys, held, reused=len(keys) - len(todo))


@dataclass(frozen=True)
class _Job:
    """The prompts `todo` (indices into the set) to decode into new shards of `store`."""

    model: ModelConfig
    trajectory: TrajectoryConfig
    store: Path
    prompt_set: PromptSet
    keys: list[str]
    todo: list[int]
    tokenizer_fp: str
    references: list[list[int]] | None = None  # an anchored round's responses, one per prompt of the set


def _references(chosen: Selection, anchor: Path, prompt_set: PromptSet, tokenizer_fp: str) -> list[list[int]]:
    """The anchor selection's (`chosen`, read from `anchor`) response to each prompt of the set, which must hold
    every one of them."""
    if chosen.settings.get("tokenizer_fingerprint") not in (None, tokenizer_fp):
        raise ConfigError(
            f"anchor {anchor} was decoded with another tokenizer; anchor a stage of the same model family"
        )
    known = responses(chosen.files())
    out = []
    for pid, tokens in zip(prompt_set.ids, prompt_set.token_ids):
        if pid not in known:
            raise ConfigError(
                f"prompt {pid!r} is not in the anchor's trajectories ({anchor}): anchor a stage decoded on these prompts"
            )
        if known[pid][0] != list(tokens):
            raise ConfigError(f"prompt {pid!r} reads differently in the anchor's trajectories ({anchor}); re-decode it")
        out.append(known[pid][1])
    return out


def _decode(job: _Job, ray_config: RayConfig, prompts_per_shard: int, log, progress) -> dict[str, str]:
    """Decode the job's prompts into new shards; returns their key -> shard name."""
    workers = start_workers(TrajectoryWorker, ray_config, asdict(job.model), asdict(job.trajectory))
    model_fp, worker_tokenizer_fp = get(workers[0].fingerprints.remote())
    log(f"{len(workers)} workers ready (pids {get([w.pid.remote() for w in workers])})")
    if worker_tokenizer_fp != job.tokenizer_fp:
        raise RuntimeError("the workers loaded a different tokenizer than the driver; check the model path")
    settings = {
        "model": asdict(job.model),
        "model_fingerprint": model_fp,
        "tokenizer_fingerprint": job.tokenizer_fp,
        "trajectory": asdict(job.trajectory),
    }
    if job.references is not None:  # the fixed points are another store's text (generate_trajectories' anchor)
        settings["anchored"] = True
    manifest = read_manifest(job.store)
    recorded = manifest.get("settings", {}).get("model_fingerprint")
    if recorded not in (None, model_fp):
        raise RuntimeError(
            f"{job.store} holds trajectories of weights {recorded}, but the files it was named after now "
            f"load as {model_fp}; move the store away (its files were rewritten in place?)"
        )
    names = [int(m.group(1)) for name in manifest["shards"] if (m := re.match(r"shard-(\d+)", name))]
    specs = plan_shards(len(job.todo), prompts_per_shard, first_index=max(names, default=-1) + 1)

    def submit(worker, spec: ShardSpec):
        chosen = job.todo[spec.start : spec.stop]
        return worker.run.remote(
            spec,
            [job.prompt_set.ids[i] for i in chosen],
            [job.prompt_set.token_ids[i] for i in chosen],
            [job.keys[i] for i in chosen],
            str(job.store),
            [job.references[i] for i in chosen] if job.references else None,
        )

    fill_shards(job.store, specs, workers, submit, settings, log, progress)
    return {job.keys[i]: spec.name for spec in specs for i in job.todo[spec.start : spec.stop]}


def _write_selection(store: Path, prompt_set: PromptSet, keys: list[str], held: dict[str, str], reused: int) -> Path:
    shards: dict[str, list[str]] = {}
    for prompt_id, key in zip(prompt_set.ids, keys):
        shards.setdefault(held[key], []).append(prompt_id)
    selection = Selection(
        store=str(store),
        prompts_fingerprint=prompt_set.fingerprint(),
        num_prompts=len(keys),
        skipped_too_long=prompt_set.skipped_too_long,
        reused=reused,
        decoded=len(keys) - reused,
        shards=dict(sorted(shards.items())),
        settings=read_manifest(store).get("settings", {}),
    )
    path = store / SETS / f"{prompt_set.fingerprint()}.json"
    selection.write(path)
    return path


def newest_selection(folder: Path) -> Path:
    """The newest selection file under a stage's trajectories/ folder: what a skipped stage hands on."""
    found = list(folder.glob(f"*/{SETS}/*.json"))
    if not found:
        raise ConfigError(f"stage 'trajectories' skipped, but {folder} holds no finished run; include 'trajectories'")
    return max(found, key=lambda p: p.stat().st_mtime)


@task(name=TRAJECTORIES, retries=1, retry_delay_seconds=5)
def trajectories_task(
    plan: StagePlan,
    ray: RayConfig,
    prompts_per_shard: int,
    tracking: TrackingConfig,
    run: bool = True,
    anchor: str | None = None,
) -> TrajectoriesResult:
    """The stage in a flow: decode what the store lacks (a retry resumes) and record it in MLflow; or, when
    skipped (`run` false), hand on the newest earlier selection. `anchor`: the selection of the stage a curriculum
    stage is anchored to (CurriculumStage.anchor)."""
    log = get_run_logger().info
    if plan.label:
        log(f"curriculum stage {plan.label}: block size {plan.trajectories.block_size}, from {plan.model.name_or_path}")
    if not run:
        return TrajectoriesResult(str(newest_selection(plan.path(TRAJECTORIES))), ran=False)
    selection = generate_trajectories(
        plan.model,
        plan.prompts,
        plan.trajectories,
        ray,
        plan.path(TRAJECTORIES),
        prompts_per_shard,
        log=log,
        progress=progress_artifact(TRAJECTORIES),
        anchor=anchor,
    )
    result = TrajectoriesResult(str(selection), ran=True)
    if tracking.uri:
        chosen = result.read()
        params = {
            "model": asdict(plan.model),
            "prompts": asdict(plan.prompts),
            "trajectories": asdict(plan.trajectories),
            "ray": asdict(ray),
            "store": chosen.store,
            "anchor": anchor,
        }
        figures = {
            "prompts": chosen.num_prompts,
            "skipped_too_long": chosen.skipped_too_long,
            "reused_prompts": chosen.reused,
            "decoded_prompts": chosen.decoded,
            "shards": len(chosen.shards),
        }
        path = builtin_prompts_path() if plan.prompts.path == BUILTIN else Path(plan.prompts.path).expanduser()
        source = str(path.resolve()) if path.exists() else plan.prompts.path  # else a hub id
        prompts = DataInput("prompts", source, chosen.prompts_fingerprint, chosen.num_prompts, "prompts")
        record_stage(tracking, plan.run_name(TRAJECTORIES), TRAJECTORIES, params, figures, [selection], [prompts])
    return result
