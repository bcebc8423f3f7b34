"""Ray for the stages that fan out over model replicas: where it runs, and one local Ray per stage if none is up."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from jfcore.config import check
from jfcore.shards import ShardSpec, completed_shards, record_shard, remove_stale_temporaries

# Offline and quiet: Ray must not phone home, and 2.60 turns token auth on by default.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray


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


@contextlib.contextmanager
def ray_session(config: RayConfig) -> Iterator[None]:
    """Use the Ray this process is connected to, else connect (or start a local one) for the block."""
    if ray.is_initialized():
        yield
        return
    local = {"num_cpus": config.num_workers * config.cpus_per_worker, "include_dashboard": False,
             "object_store_memory": config.object_store_mb << 20} if config.address is None else {}  # fmt: skip
    ray.init(address=config.address, log_to_driver=False, **local)
    try:
        yield
    finally:
        ray.shutdown()


def start_workers(cls: type, config: RayConfig, *args) -> list:
    """`config.num_workers` actors of `cls(*args, threads)`; a killed one comes back and redoes its task."""
    actor = ray.remote(cls).options(
        num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker, max_restarts=2, max_task_retries=2
    )
    return [actor.remote(*args, config.cpus_per_worker) for _ in range(config.num_workers)]


def fill_shards(folder: Path, specs: list[ShardSpec], workers: list, submit: Callable, settings: dict,
                log: Callable[[str], None]) -> None:  # fmt: skip
    """Make every shard of `specs` in `folder` that its manifest does not list yet.

    `submit(worker, spec)` returns the Ray ref of a task that writes the shard and returns its `ShardRecord`.
    Shards go to the workers in turn; each is added to the manifest as soon as it lands, so a killed run
    loses only the shards in flight.
    """
    remove_stale_temporaries(folder)
    done = completed_shards(folder, specs)
    todo = [s for s in specs if s.name not in done]
    log(f"run folder {folder}: {len(done)}/{len(specs)} shards already complete, {len(todo)} to make")
    start = time.perf_counter()
    pending = {submit(workers[i % len(workers)], spec): spec for i, spec in enumerate(todo)}
    finished = len(done)
    while pending:
        [ref], _ = ray.wait(list(pending), num_returns=1)
        pending.pop(ref)
        record = ray.get(ref)
        record_shard(folder, record, settings)
        finished += 1
        log(f"shard {finished}/{len(specs)} done: {record.name}, {record.rows} rows ({time.perf_counter() - start:.0f} s)")
