"""Ray for the stages that fan out over model replicas: where it runs, and one local Ray per stage if none is up.

Without Ray (not installed, or `address: none`), a stage runs its worker in this process, or
with `num_workers` > 1 each worker in a spawned process of its own (several model replicas
on one GPU keep it busy where batch-1 decoding alone would not), through the same calls
(`worker.method.remote(...)`, `get`), so the stages run on a machine that has only torch and
transformers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from jfcore.config import check
from jfcore.environment import apply_defaults
from jfcore.shards import ShardSpec, completed_shards, record_shard, remove_stale_temporaries

apply_defaults()  # quiet: Ray must not phone home, and 2.60 turns token auth on by default

NO_RAY = "none"  # RayConfig.address: run one worker in this process


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    address: str | None = (
        None  # None: a local Ray for this run; "auto" or "ray://host:10001": a cluster; "none": no Ray
    )
    num_workers: int = 1  # model replicas
    cpus_per_worker: int = 1
    gpus_per_worker: float = 0.0  # 1 per replica on GPU machines
    object_store_mb: int = 256  # local Ray only

    def __post_init__(self) -> None:
        check(self.num_workers >= 1, f"num_workers must be >= 1, got {self.num_workers}")
        check(self.cpus_per_worker >= 1, f"cpus_per_worker must be >= 1, got {self.cpus_per_worker}")
        check(self.gpus_per_worker >= 0, f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}")

    @property
    def in_process(self) -> bool:
        return self.address == NO_RAY or (self.address is None and importlib.util.find_spec("ray") is None)


@contextlib.contextmanager
def ray_session(config: RayConfig) -> Iterator[None]:
    """Use the Ray this process is connected to, else connect (or start a local one) for the block."""
    if config.in_process:
        try:
            yield
        finally:  # a worker process holds its model (and GPU memory) until it ends
            while _process_workers:
                _process_workers.pop().stop()
        return
    import ray

    if ray.is_initialized():
        yield
        return
    local = (
        {
            "num_cpus": config.num_workers * config.cpus_per_worker,
            "include_dashboard": False,
            "object_store_memory": config.object_store_mb << 20,
        }
        if config.address is None
        else {}
    )
    ray.init(address=config.address, log_to_driver=False, **local)
    try:
        yield
    finally:
        ray.shutdown()


class InProcessWorker:
    """A worker object in this process, called the way a Ray actor is: `worker.method.remote(...)`."""

    def __init__(self, target: object):
        self._target = target

    def __getattr__(self, name: str):
        method = getattr(self._target, name)
        return SimpleNamespace(remote=lambda *args, **kwargs: _run_now(method, args, kwargs))


def _run_now(method: Callable, args: tuple, kwargs: dict) -> Future:
    """The call, made now (an error is raised here); its result in a finished future, as a process worker's."""
    future: Future = Future()
    future.set_result(method(*args, **kwargs))
    return future


_hosted: object = None  # the worker object, in a worker process
_process_workers: list[ProcessWorker] = []  # started in this process, stopped when their session ends


def _host(cls: type, args: tuple) -> None:
    global _hosted
    _hosted = cls(*args)


def _call(name: str, args: tuple, kwargs: dict):
    return getattr(_hosted, name)(*args, **kwargs)


class ProcessWorker:
    """A worker object in a spawned process of its own, called the way a Ray actor is; calls return futures."""

    def __init__(self, cls: type, args: tuple):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._pool = ProcessPoolExecutor(1, mp_context=context, initializer=_host, initargs=(cls, args))
        _process_workers.append(self)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return SimpleNamespace(remote=lambda *args, **kwargs: self._pool.submit(_call, name, args, kwargs))

    def stop(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def get(refs):
    """`ray.get` for Ray refs and in-process calls alike (one, or a list)."""
    if isinstance(refs, list):
        return [get(r) for r in refs]
    if isinstance(refs, Future):
        return refs.result()
    import ray

    return ray.get(refs)


def start_workers(cls: type, config: RayConfig, *args) -> list:
    """`config.num_workers` actors of `cls(*args, threads)`; a killed one comes back and redoes its task.
    Without Ray: one `cls` instance in this process, or one worker process per replica."""
    if config.in_process and config.num_workers == 1:
        return [InProcessWorker(cls(*args, config.cpus_per_worker))]
    if config.in_process:
        return [ProcessWorker(cls, (*args, config.cpus_per_worker)) for _ in range(config.num_workers)]
    import ray

    actor = ray.remote(cls).options(
        num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker, max_restarts=2, max_task_retries=2
    )
    return [actor.remote(*args, config.cpus_per_worker) for _ in range(config.num_workers)]


def fill_shards(
    folder: Path,
    specs: list[ShardSpec],
    workers: list,
    submit: Callable,
    settings: dict,
    log: Callable[[str], None],
    progress: Callable[..., None] | None = None,  # tasks.orchestration.Progress
) -> None:
    """Make every shard of `specs` in `folder` that its manifest does not list yet.

    `submit(worker, spec)` returns the Ray ref of a task that writes the shard and returns its `ShardRecord`.
    Shards go to whichever worker is free; each is added to the manifest as soon as it lands, so a killed
    run loses only the shards in flight.
    """
    remove_stale_temporaries(folder)
    done = completed_shards(folder, specs)
    todo = [s for s in specs if s.name not in done]
    log(f"run folder {folder}: {len(done)}/{len(specs)} shards already complete, {len(todo)} to make")
    if progress:
        progress(len(done), len(specs))
    start = time.perf_counter()
    finished = len(done)

    def landed(record) -> None:
        nonlocal finished
        record_shard(folder, record, settings)
        finished += 1
        elapsed, made = time.perf_counter() - start, finished - len(done)
        eta = elapsed / made * (len(specs) - finished)
        log(f"shard {finished}/{len(specs)} done: {record.name}, {record.rows} rows ({elapsed:.0f} s, ETA {eta:.0f} s)")
        if progress:
            progress(finished, len(specs))

    # Each worker holds one shard at a time and gets the next when it hands one in: a slow or restarted
    # worker does not hold back shards another could be making.
    running = {submit(worker, todo.pop(0)): worker for worker in workers[: len(todo)]}
    while running:
        for ref in _first_finished(list(running)):
            worker = running.pop(ref)
            landed(get(ref))
            if todo:
                running[submit(worker, todo.pop(0))] = worker


def _first_finished(refs: list) -> list:
    """The calls among `refs` that have finished, waiting for at least one (Ray refs or futures)."""
    if isinstance(refs[0], Future):
        return list(wait(refs, return_when=FIRST_COMPLETED)[0])
    import ray

    return ray.wait(refs, num_returns=1)[0]
