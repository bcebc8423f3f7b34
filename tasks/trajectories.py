"""Trajectory generation: Ray actors, one model replica each, write Parquet shards.

The driver encodes the prompts, asks a worker for the model and tokenizer
fingerprints, and names the run folder by everything that determines its
content. Shards already listed in that folder's manifest are skipped; the
rest are spread over the workers, and each finished shard is added to the
manifest as soon as it lands. A killed worker is restarted by Ray and its
shard redone; a killed run loses only the shards in flight.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from jfcore.config import from_dict
from jfcore.models import ModelConfig, load_model, load_tokenizer, model_fingerprint, tokenizer_fingerprint
from jfcore.prompts import PromptSource, encode_prompts
from jfcore.shards import ShardSpec, plan_shards, read_manifest, run_key, write_manifest, write_shard
from jfcore.trajectories import TrajectoryConfig, decode_trajectories
from tasks.orchestration import get_run_logger, task
from tasks.ray_workers import RayConfig, fill_shards, get, ray_session, start_workers


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

    def run(self, spec: ShardSpec, ids: list[str], prompts: list[list[int]], folder: str):
        table = decode_trajectories(self.model, ids, prompts, self.config, self.model_fp, self.tokenizer_fp)
        return write_shard(table, Path(folder), spec, len(prompts))


def generate_trajectories(
    model: ModelConfig,
    prompts: PromptSource,
    trajectory: TrajectoryConfig,
    ray_config: RayConfig,
    out_dir: str | Path,
    prompts_per_shard: int = 64,
    log: Callable[[str], None] = print,
) -> Path:
    """Generate (or finish generating) the trajectory shards; returns the run folder."""
    tokenizer = load_tokenizer(model)
    prompt_set = encode_prompts(prompts, tokenizer)
    if not prompt_set.ids:
        raise ValueError(f"no usable prompts in {prompts.path} ({prompt_set.skipped_too_long} longer than the budget)")
    log(f"{len(prompt_set.ids)} prompts ({prompt_set.skipped_too_long} skipped: over {prompts.max_prompt_tokens} tokens)")

    with ray_session(ray_config):
        return _run(model, prompt_set, tokenizer, trajectory, ray_config, Path(out_dir), prompts_per_shard, log)


def _run(model, prompt_set, tokenizer, trajectory, ray_config, out_dir, prompts_per_shard, log) -> Path:
    workers = start_workers(TrajectoryWorker, ray_config, asdict(model), asdict(trajectory))
    model_fp, tokenizer_fp = get(workers[0].fingerprints.remote())
    log(f"{len(workers)} workers ready (pids {get([w.pid.remote() for w in workers])})")
    if tokenizer_fp != tokenizer_fingerprint(tokenizer):
        raise RuntimeError("the workers loaded a different tokenizer than the driver; check the model path")
    settings = {
        "model": asdict(model),
        "model_fingerprint": model_fp,
        "tokenizer_fingerprint": tokenizer_fp,
        "prompts_fingerprint": prompt_set.fingerprint(),
        "trajectory": asdict(trajectory),
        "prompts_per_shard": prompts_per_shard,
    }
    folder = out_dir / run_key(**{k: v for k, v in settings.items() if k != "model"})
    specs = plan_shards(len(prompt_set.ids), prompts_per_shard)

    def submit(worker, spec: ShardSpec):
        ids, token_ids = prompt_set.ids[spec.start : spec.stop], prompt_set.token_ids[spec.start : spec.stop]
        return worker.run.remote(spec, ids, token_ids, str(folder))

    fill_shards(folder, specs, workers, submit, settings, log)
    manifest = read_manifest(folder)
    manifest |= {"settings": settings, "complete": True, "num_prompts": len(prompt_set.ids),
                 "skipped_too_long": prompt_set.skipped_too_long}
    write_manifest(folder, manifest)
    return folder


@task(name="generate-trajectories", retries=1, retry_delay_seconds=5)
def generate_trajectories_task(
    model: dict, prompts: dict, trajectory: dict, ray: dict, out_dir: str, prompts_per_shard: int = 64
) -> str:
    """Prefect task over `generate_trajectories`: configs as plain data, checked strictly; a retry resumes."""
    folder = generate_trajectories(
        from_dict(ModelConfig, model, "model"),
        from_dict(PromptSource, prompts, "prompts"),
        from_dict(TrajectoryConfig, trajectory, "trajectory"),
        from_dict(RayConfig, ray, "ray"),
        out_dir,
        prompts_per_shard,
        log=get_run_logger().info,
    )
    return str(folder)
