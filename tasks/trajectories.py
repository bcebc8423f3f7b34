"""Trajectory generation: Ray actors, one model replica each, write Parquet shards into a trajectory store.

A store is a folder named by everything that determines a prompt's trajectory
but the prompt: the model's source fingerprint, the tokenizer and the decoding
settings. Each shard's manifest entry lists the prompts it holds (by a digest of
id and token ids), so a rerun decodes only the prompts no verified shard holds:
appended prompts cost only themselves, an unchanged prompt set starts no worker.
Shards are spread over the workers and added to the manifest as they land: a
killed worker is restarted by Ray and its shard redone; a killed run loses only
the shards in flight. The stage's output is a selection file in the store
(`sets/<prompt set fingerprint>.json`): which shard holds which prompt of this set.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from jfcore.atomic import atomic_write
from jfcore.config import from_dict
from jfcore.models import (
    ModelConfig,
    load_model,
    load_tokenizer,
    model_fingerprint,
    source_fingerprint,
    tokenizer_fingerprint,
)
from jfcore.prompts import PromptSet, PromptSource, encode_prompts
from jfcore.shards import ShardSpec, drop_unverified, plan_shards, read_manifest, run_key, write_shard
from jfcore.trajectories import TrajectoryConfig, decode_trajectories
from tasks.orchestration import get_run_logger, progress_artifact, task
from tasks.ray_workers import RayConfig, fill_shards, get, ray_session, start_workers

SETS = "sets"  # in a store: one selection file per prompt set


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

    def run(self, spec: ShardSpec, ids: list[str], prompts: list[list[int]], keys: list[str], folder: str):
        table = decode_trajectories(self.model, ids, prompts, self.config, self.model_fp, self.tokenizer_fp)
        return write_shard(table, Path(folder), spec, len(prompts), tuple(keys))


def generate_trajectories(
    model: ModelConfig,
    prompts: PromptSource,
    trajectory: TrajectoryConfig,
    ray_config: RayConfig,
    out_dir: str | Path,
    prompts_per_shard: int = 64,
    log: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Decode the prompts the store does not hold yet; returns the prompt set's selection file."""
    tokenizer = load_tokenizer(model)
    prompt_set = encode_prompts(prompts, tokenizer)
    if not prompt_set.ids:
        raise ValueError(f"no usable prompts in {prompts.path} ({prompt_set.skipped_too_long} longer than the budget)")
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    store = Path(out_dir) / run_key(
        model=source_fingerprint(model), tokenizer=tokenizer_fp, trajectory=asdict(trajectory)
    )
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
        with ray_session(ray_config):
            held |= _decode(
                model,
                prompt_set,
                keys,
                todo,
                tokenizer_fp,
                trajectory,
                ray_config,
                store,
                prompts_per_shard,
                log,
                progress,
            )
    return _write_selection(store, prompt_set, keys, held, reused=len(keys) - len(todo))


def _decode(
    model,
    prompt_set: PromptSet,
    keys,
    todo,
    tokenizer_fp,
    trajectory,
    ray_config,
    store,
    prompts_per_shard,
    log,
    progress,
) -> dict[str, str]:
    """Decode the prompts `todo` (indices into the set) into new shards; returns their key -> shard name."""
    workers = start_workers(TrajectoryWorker, ray_config, asdict(model), asdict(trajectory))
    model_fp, worker_tokenizer_fp = get(workers[0].fingerprints.remote())
    log(f"{len(workers)} workers ready (pids {get([w.pid.remote() for w in workers])})")
    if worker_tokenizer_fp != tokenizer_fp:
        raise RuntimeError("the workers loaded a different tokenizer than the driver; check the model path")
    settings = {
        "model": asdict(model),
        "model_fingerprint": model_fp,
        "tokenizer_fingerprint": tokenizer_fp,
        "trajectory": asdict(trajectory),
    }
    manifest = read_manifest(store)
    recorded = manifest.get("settings", {}).get("model_fingerprint")
    if recorded not in (None, model_fp):
        raise RuntimeError(
            f"{store} holds trajectories of weights {recorded}, but the files it was named after now "
            f"load as {model_fp}; move the store away (its files were rewritten in place?)"
        )
    names = [int(m.group(1)) for name in manifest["shards"] if (m := re.match(r"shard-(\d+)", name))]
    specs = plan_shards(len(todo), prompts_per_shard, first_index=max(names, default=-1) + 1)

    def submit(worker, spec: ShardSpec):
        chosen = todo[spec.start : spec.stop]
        return worker.run.remote(
            spec,
            [prompt_set.ids[i] for i in chosen],
            [prompt_set.token_ids[i] for i in chosen],
            [keys[i] for i in chosen],
            str(store),
        )

    fill_shards(store, specs, workers, submit, settings, log, progress)
    return {keys[i]: spec.name for spec in specs for i in todo[spec.start : spec.stop]}


def _write_selection(store: Path, prompt_set: PromptSet, keys: list[str], held: dict[str, str], reused: int) -> Path:
    shards: dict[str, list[str]] = {}
    for prompt_id, key in zip(prompt_set.ids, keys):
        shards.setdefault(held[key], []).append(prompt_id)
    selection = {
        "complete": True,
        "store": str(store),
        "prompts_fingerprint": prompt_set.fingerprint(),
        "num_prompts": len(keys),
        "skipped_too_long": prompt_set.skipped_too_long,
        "reused": reused,
        "decoded": len(keys) - reused,
        "shards": dict(sorted(shards.items())),
        "settings": read_manifest(store).get("settings", {}),
    }
    path = store / SETS / f"{prompt_set.fingerprint()}.json"
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(selection, indent=1)))
    return path


@task(name="generate-trajectories", retries=1, retry_delay_seconds=5)
def generate_trajectories_task(
    model: dict, prompts: dict, trajectory: dict, ray: dict, out_dir: str, prompts_per_shard: int = 64
) -> str:
    """Prefect task over `generate_trajectories`: configs as plain data, checked strictly; a retry resumes.
    Returns the selection file's path."""
    folder = generate_trajectories(
        from_dict(ModelConfig, model, "model"),
        from_dict(PromptSource, prompts, "prompts"),
        from_dict(TrajectoryConfig, trajectory, "trajectory"),
        from_dict(RayConfig, ray, "ray"),
        out_dir,
        prompts_per_shard,
        log=get_run_logger().info,
        progress=progress_artifact("trajectories"),
    )
    return str(folder)
