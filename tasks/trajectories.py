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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import get_run_logger, task

from jfcore.config import check, from_dict
from jfcore.models import ModelConfig, load_model, load_tokenizer, model_fingerprint, tokenizer_fingerprint
from jfcore.prompts import PromptSource, encode_prompts
from jfcore.shards import (
    ShardSpec,
    completed_shards,
    plan_shards,
    read_manifest,
    record_shard,
    remove_stale_temporaries,
    run_key,
    write_manifest,
    write_shard,
)
from jfcore.trajectories import TrajectoryConfig, decode_trajectories

# Offline and quiet: Ray must not phone home, and 2.60 turns token auth on by default.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402  (after the environment above)


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # None: a local Ray for this run; "auto" or "ray://host:10001": a cluster
    num_workers: int = 1  # model replicas
    cpus_per_worker: int = 1
    gpus_per_worker: float = 0.0  # 1 per replica on GPU machines
    object_store_mb: int = 256  # local Ray only

    def __post_init__(self) -> None:
        check(self.num_workers >= 1, f"num_workers must be >= 1, got {self.num_workers}")
        check(self.cpus_per_worker >= 1, f"cpus_per_worker must be >= 1, got {self.cpus_per_worker}")
        check(self.gpus_per_worker >= 0, f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}")


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

    started_ray = not ray.is_initialized()
    if started_ray:
        local = {"num_cpus": ray_config.num_workers * ray_config.cpus_per_worker, "include_dashboard": False,
                 "object_store_memory": ray_config.object_store_mb << 20} if ray_config.address is None else {}
        ray.init(address=ray_config.address, log_to_driver=False, **local)
    try:
        return _run(model, prompt_set, tokenizer, trajectory, ray_config, Path(out_dir), prompts_per_shard, log)
    finally:
        if started_ray:
            ray.shutdown()


def _run(model, prompt_set, tokenizer, trajectory, ray_config, out_dir, prompts_per_shard, log) -> Path:
    actor = ray.remote(TrajectoryWorker).options(
        num_cpus=ray_config.cpus_per_worker,
        num_gpus=ray_config.gpus_per_worker,
        max_restarts=2,  # a killed worker comes back ...
        max_task_retries=2,  # ... and redoes the shard it held
    )
    workers = [
        actor.remote(asdict(model), asdict(trajectory), ray_config.cpus_per_worker)
        for _ in range(ray_config.num_workers)
    ]
    model_fp, tokenizer_fp = ray.get(workers[0].fingerprints.remote())
    log(f"{len(workers)} workers ready (pids {ray.get([w.pid.remote() for w in workers])})")
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
    remove_stale_temporaries(folder)
    done = completed_shards(folder, specs)
    todo = [s for s in specs if s.name not in done]
    log(f"run folder {folder}: {len(done)}/{len(specs)} shards already complete, {len(todo)} to generate")

    start = time.perf_counter()
    pending = {
        workers[i % len(workers)].run.remote(
            spec, prompt_set.ids[spec.start : spec.stop], prompt_set.token_ids[spec.start : spec.stop], str(folder)
        ): spec
        for i, spec in enumerate(todo)
    }
    finished = len(done)
    while pending:
        [ref], _ = ray.wait(list(pending), num_returns=1)
        pending.pop(ref)
        record = ray.get(ref)
        record_shard(folder, record, settings)
        finished += 1
        elapsed = time.perf_counter() - start
        log(f"shard {finished}/{len(specs)} done: {record.name}, {record.rows} rows ({elapsed:.0f} s)")
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
