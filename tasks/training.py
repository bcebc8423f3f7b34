"""The training stage: a multi-process DeepSpeed job launched with torchrun, tracked in MLflow.

`run_training` trains into one run folder; `training_stage` picks that folder
(`training/<digest of the settings, launch, data and model>`, `training/latest`
naming the newest) and reuses a finished run whose export verifies;
`training_task` is the stage as a Prefect task. One process per visible GPU, or
`processes` CPU processes over gloo. A failed or killed job leaves its
checkpoints: running the stage again resumes from the newest complete one,
logging into the same MLflow run.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from jfcore.atomic import atomic_write
from jfcore.config import ConfigError, check, replace_checked, to_dict
from jfcore.contracts import (
    CHECKPOINTS,
    DEEPSPEED_CONFIG,
    FAILURE_PREFIX,
    FINAL,
    LATEST,
    LAUNCH_FILE,
    LAUNCH_LOG,
    METRICS,
    TRAINING,
)
from jfcore.environment import cache_dir, threads_per_process
from jfcore.models import load_tokenizer, source_fingerprint, tokenizer_fingerprint, with_absolute_path
from jfcore.shards import run_key
from jfcore.training.checkpoints import complete_checkpoints, export_problem, read_metrics, write_export_sums
from jfcore.training.config import TrainConfig
from jfcore.training.data import packing_stats
from jfcore.training.loop import PROGRESS_LINE, deepspeed_config
from tasks.launch_guard import GRACE_S
from tasks.orchestration import Progress, get_run_logger, progress_artifact, task
from tasks.plan import StagePlan
from tasks.tracking import (
    TrackingConfig,
    client,
    log_data_inputs,
    log_model_by_path,
    logged_model,
    packed_input,
    stage_run,
)

INFRA_DEEPSPEED = Path(__file__).resolve().parents[1] / "infra" / "deepspeed"
# torchrun's own post-mortem starts here; the lines before it are the ranks' (the real cause)
POST_MORTEM = "torch/distributed/elastic/multiprocessing/api.py"
# A Python warning as the ranks print it ("path:line: FutureWarning: ...") and the source line under it. Under
# ZeRO-3 the library's deprecation warnings come in dozens, and crowded the real cause out of the tail.
WARNING_LINE = re.compile(r"^\S+:\d+: \w*Warning: ")


class ErrorTail:
    """The last lines the ranks printed before torchrun's post-mortem, less Python warnings: what a failure shows."""

    def __init__(self, keep: int = 40) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._post_mortem = self._after_warning = False

    def add(self, line: str) -> None:
        self._post_mortem = self._post_mortem or POST_MORTEM in line
        was_warning, self._after_warning = self._after_warning, bool(WARNING_LINE.match(line))
        if self._post_mortem or self._after_warning or (was_warning and line[:1].isspace()):  # its source line
            return
        self.lines.append(line.rstrip())


class TrainingFailed(RuntimeError):
    """The training processes exited with an error."""


@dataclass(frozen=True)
class TrainingResult:
    folder: str  # the training run's folder (jfcore.training.checkpoints)
    model: dict | None  # what MLflow logged: model_uri, registered_model, version; None without tracking
    reused: bool  # a finished run with these settings was reused: nothing was trained
    metrics: dict  # the last optimizer step's record
    mlflow_run_id: str | None = None

    @property
    def final(self) -> str:
        """The trained model: a plain HF checkpoint."""
        return str(Path(self.folder) / FINAL)

    @property
    def version(self) -> str | None:
        """Its registered version, if it was registered."""
        version = (self.model or {}).get("version")
        return None if version is None else str(version)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    processes: int | None = None  # default: one per visible GPU, else 2 CPU processes
    deepspeed_config: str = "zero2"  # a name in infra/deepspeed/ (zero0..zero3, zero3_offload) or a JSON path
    threads_per_process: int | None = None  # CPU torch threads per process; default: cores / processes
    timeout_s: float | None = None  # kill the job after this long (it can be resumed)
    # Several machines: the same command runs on each, with its own node_rank; every node reaches the others
    # through torchrun's c10d rendezvous at `rendezvous` (host:port of node 0), and output_dir, the data and
    # the model are on storage every node shares. Node 0 keeps the books (launch file, MLflow run, export
    # record); the others wait for its launch file and join.
    nodes: int = 1
    node_rank: int = 0
    rendezvous: str | None = None
    rendezvous_timeout_s: float = 900  # how long a node waits for the others to join

    def __post_init__(self) -> None:
        check(
            self.processes is None or self.processes >= 1, f"LaunchConfig.processes: must be >= 1, got {self.processes}"
        )
        check(self.nodes >= 1, f"LaunchConfig.nodes: must be >= 1, got {self.nodes}")
        check(
            0 <= self.node_rank < self.nodes,
            f"LaunchConfig.node_rank: must be in 0..{self.nodes - 1} (nodes={self.nodes}), got {self.node_rank}",
        )
        check(
            self.nodes == 1 or re.fullmatch(r"[\w.\-\[\]:]+:\d+", self.rendezvous or "") is not None,
            f"LaunchConfig.rendezvous: {self.nodes} nodes meet at a c10d rendezvous; set it to node 0's host:port "
            f"(e.g. 10.0.0.1:29400), got {self.rendezvous!r}",
        )
        check(
            self.threads_per_process is None or self.threads_per_process >= 1,
            f"LaunchConfig.threads_per_process: must be >= 1, got {self.threads_per_process}",
        )


def load_deepspeed_config(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not path.suffix:
        path = INFRA_DEEPSPEED / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in INFRA_DEEPSPEED.glob("*.json")))
        raise ConfigError(f"DeepSpeed config {name_or_path!r} not found ({path}); use one of {known} or a JSON path")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {err}") from err


def run_training(
    train: TrainConfig,
    launch: LaunchConfig | None = None,
    tracking: TrackingConfig | None = None,
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> TrainingResult:
    """Train (or resume) to the end and export; returns where the model is and what MLflow holds."""
    launch, tracking = launch or LaunchConfig(), tracking or TrackingConfig()
    train = _absolute_paths(train)  # the processes must read the same files, whatever their working folder
    out = Path(train.output_dir)
    deepspeed_base = load_deepspeed_config(launch.deepspeed_config)
    deepspeed_config(deepspeed_base, train, 1, False)  # refuses clashing keys before anything starts
    # Fail here, in seconds, rather than after the processes start: a missing model or foreign data.
    packed = packing_stats(train.data, tokenizer_fingerprint(load_tokenizer(train.model)))
    if launch.node_rank > 0:
        return _join(train, launch, log, progress)
    out.mkdir(parents=True, exist_ok=True)
    run_id = None
    if tracking.uri:
        params = {"training": to_dict(train), "launch": to_dict(launch), "deepspeed": deepspeed_base}
        run_id = stage_run(tracking, out, TRAINING, params)
        log_data_inputs(tracking, run_id, [packed_input(train.data, packed["sequences"])])
    launch_file = out / LAUNCH_FILE
    content = {"training": to_dict(train), "deepspeed": deepspeed_base, "tracking": to_dict(tracking), "run_id": run_id}
    atomic_write(launch_file, lambda tmp: tmp.write_text(json.dumps(content, indent=2)))
    resumed = complete_checkpoints(out / CHECKPOINTS)
    log(f"training into {out}" + (f", resuming from {resumed[-1]}" if resumed and train.resume else ""))
    try:
        _launch(launch_file, launch, log, progress)
    except BaseException:
        if run_id:
            client(tracking).set_terminated(run_id, "FAILED")  # a rerun resumes it: RUNNING again
        raise

    model, last = None, _last_metrics(out / METRICS)
    if run_id:
        model = logged_model(out)
        if model is None:
            mlflow = client(tracking)
            for name in (DEEPSPEED_CONFIG, METRICS, LAUNCH_FILE, LAUNCH_LOG):
                mlflow.log_artifact(run_id, str(out / name), artifact_path=TRAINING)
            model = log_model_by_path(tracking, run_id, out / FINAL, out, last.get("step", 0))  # ends the run
        else:
            client(tracking).set_terminated(run_id, "FINISHED")
        registered = (
            f", registered as {tracking.registered_model} v{model['version']}" if tracking.registered_model else ""
        )
        log(f"model in MLflow run {run_id}: {model['model_uri']}{registered}")
    return TrainingResult(str(out), model, reused=False, metrics=last, mlflow_run_id=run_id)


def _join(
    train: TrainConfig, launch: LaunchConfig, log: Callable[[str], None], progress: Progress | None
) -> TrainingResult:
    """Another node of a multi-node job: wait for node 0's launch file (the shared settings), then run this
    node's processes. Node 0 keeps the books, so this returns no MLflow record."""
    out = Path(train.output_dir)
    launch_file = out / LAUNCH_FILE
    deadline = time.time() + launch.rendezvous_timeout_s
    wanted = json.loads(json.dumps(to_dict(train)))  # as the launch file holds it (tuples become lists)
    while not (launch_file.is_file() and json.loads(launch_file.read_text())["training"] == wanted):
        if time.time() > deadline:
            raise TrainingFailed(
                f"node {launch.node_rank}: node 0 has not written {launch_file} for these settings within "
                f"{launch.rendezvous_timeout_s:.0f} s; start node 0 with the same recipe (output_dir must be shared)"
            )
        time.sleep(1)
    log(f"node {launch.node_rank} of {launch.nodes}: joining the job in {out}")
    _launch(launch_file, launch, log, progress)
    return TrainingResult(str(out), None, reused=False, metrics=_last_metrics(out / METRICS))


def _absolute_paths(train: TrainConfig) -> TrainConfig:
    return replace_checked(
        train,
        data=str(Path(train.data).resolve()),
        output_dir=str(Path(train.output_dir).resolve()),
        model=with_absolute_path(train.model),
    )


STALE_BUILD_LOCK_S = 600  # DeepSpeed's CPU ops compile in under a minute: a lock this old outlived its builder


def clear_stale_build_locks(extensions_dir: Path, log: Callable[[str], None]) -> None:
    """Remove build locks left by a killed compile of DeepSpeed's ops: torch waits on such a lock forever."""
    for lock in extensions_dir.glob("*/lock"):
        with contextlib.suppress(FileNotFoundError):
            age = time.time() - lock.stat().st_mtime
            if age > STALE_BUILD_LOCK_S:
                lock.unlink()
                log(f"removed {lock}: left {age / 60:.0f} minutes ago by a compile that was killed")


def _launch(launch_file: Path, launch: LaunchConfig, log: Callable[[str], None], progress: Progress | None) -> None:
    gpus = torch.cuda.device_count()
    processes = launch.processes or gpus or 2
    env = dict(os.environ)
    if not gpus:
        env["DS_ACCELERATOR"] = "cpu"
        threads = launch.threads_per_process or threads_per_process(processes)
        env["OMP_NUM_THREADS"] = str(threads)
    root = str(Path(__file__).resolve().parents[1])  # so `-m tasks.train_worker` imports without an install
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    clear_stale_build_locks(Path(env["TORCH_EXTENSIONS_DIR"]), log)
    command = [
        sys.executable,
        "-m",
        "tasks.launch_guard",  # ends the job if this process dies
        sys.executable,
        "-m",
        "torch.distributed.run",
        *_rendezvous(launch, launch_file),
        f"--nproc_per_node={processes}",
        "-m",
        "tasks.train_worker",
        str(launch_file),
    ]
    if launch.node_rank == 0:
        for stale in launch_file.parent.glob(f"{FAILURE_PREFIX}*.txt"):
            stale.unlink()
    log(f"launching {processes} training process(es): {' '.join(command[5:])}")
    tail = ErrorTail()
    # Its own session, so that a timeout or a cancelled task takes down every rank, not only torchrun.
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )

    def kill() -> None:  # the guard stops torchrun, which stops the ranks; SIGKILL if that hangs
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S + 10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(launch.timeout_s, kill) if launch.timeout_s else None
    try:
        if timer:
            timer.start()
        log_name = LAUNCH_LOG if launch.node_rank == 0 else f"{Path(LAUNCH_LOG).stem}.node{launch.node_rank}.log"
        with open(launch_file.parent / log_name, "a", buffering=1) as full_log:  # line by line: survives a kill
            full_log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
            for line in proc.stdout:
                full_log.write(line)
                tail.add(line)
                log(line.rstrip())
                if progress and (step := PROGRESS_LINE.match(line)):
                    note = (
                        line.split("held-out ", 1)[1].removeprefix("acceptance: ").strip()
                        if "held-out " in line
                        else None
                    )
                    progress(int(step["done"]), int(step["total"]), note)
        code = proc.wait()
    finally:
        if timer:
            timer.cancel()
        kill()
        proc.wait()
    if code != 0:
        reasons = sorted(launch_file.parent.glob(f"{FAILURE_PREFIX}*.txt"))
        why = "\n".join(f"{p.stem.removeprefix(FAILURE_PREFIX)}: {p.read_text()}" for p in reasons)
        raise TrainingFailed(
            f"training processes exited with code {code}; "
            + (f"they reported:\n{why}" if why else "their last lines were:\n" + "\n".join(tail.lines))
            + f"\nEvery line they printed is in {launch_file.parent / LAUNCH_LOG}."
            + f"\nOnce fixed (or if a process was killed), run the stage again: it resumes from the newest "
            f"checkpoint in {launch_file.parent / CHECKPOINTS}"
        )


def _rendezvous(launch: LaunchConfig, launch_file: Path) -> list[str]:
    """torchrun's arguments for finding the other processes: this machine alone, or a c10d rendezvous that
    every node's launcher joins under one job id (the run folder's, so a rerun of the same run meets again)."""
    if launch.nodes == 1:
        return ["--standalone"]
    job = hashlib.sha256(str(launch_file.parent).encode()).hexdigest()[:16]
    return [
        f"--nnodes={launch.nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={launch.rendezvous}",
        f"--rdzv-id=jf-{job}",
        f"--rdzv-conf=join_timeout={int(launch.rendezvous_timeout_s)}",
        "--max-restarts=0",  # a lost node fails the job; running the stage again resumes from its checkpoint
    ]


def _last_metrics(path: Path) -> dict:
    records = read_metrics(path)  # tolerates a torn last line, as resuming does
    return records[-1] if records else {}


def _processes_failed(task, task_run, state) -> bool:
    """Retry only a job whose processes died (a retry resumes from the newest checkpoint), not bad input."""
    try:
        state.result()
    except TrainingFailed:
        return True
    except Exception:  # noqa: BLE001 (any other failure is bad input: retrying cannot fix it)
        return False
    return False


def training_stage(
    plan: StagePlan,
    data: str,
    launch: LaunchConfig,
    tracking: TrackingConfig,
    run: bool = True,
    resume: bool = True,
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> TrainingResult:
    """Train the stage's model on `data` (a packed folder) into `training/<key>`, reusing a finished run whose
    export verifies; `resume` false starts a new `training/<key>.<n>`. Skipped (`run` false), the newest run
    (`training/latest`) must hold a trained model."""
    if not run:
        folder = (plan.path(TRAINING) / LATEST).resolve()
        if not (folder / FINAL / "config.json").is_file():
            raise ConfigError(
                f"stage 'training' skipped, but there is no trained model at {folder / FINAL}; include 'training'"
            )
        return TrainingResult(str(folder), logged_model(folder), reused=True, metrics=_last_metrics(folder / METRICS))
    train = replace_checked(plan.training, data=data, resume=True)  # a new folder has nothing to resume
    folder = _run_folder(plan.path(TRAINING), train, launch, source_fingerprint(plan.model), resume)
    _point_latest(folder)
    train = replace_checked(train, output_dir=str(folder))
    problem, logged = export_problem(folder), logged_model(folder)
    if problem is None and (logged or not tracking.uri):
        log(f"training: reused {folder} (finished; its export verifies)")
        return TrainingResult(str(folder), logged, reused=True, metrics=_last_metrics(folder / METRICS))
    if problem and (folder / FINAL).exists():
        log(f"training: {problem}; exporting again from the newest checkpoint")
        shutil.rmtree(folder / FINAL)
    if tracking.uri and not tracking.run_name:
        tracking = replace_checked(tracking, run_name=plan.run_name(TRAINING))
    result = run_training(train, launch, tracking, log, progress)
    write_export_sums(folder)
    return result


def _run_folder(root: Path, train: TrainConfig, launch: LaunchConfig, model_fingerprint: str, resume: bool) -> Path:
    """`<root>/<key>` for these settings: the newest such run when resuming, a new `<key>.<n>` otherwise."""
    identity = {k: v for k, v in to_dict(train).items() if k not in ("output_dir", "resume")}
    key = run_key(
        train=identity,
        model=model_fingerprint,
        processes=launch.processes,
        deepspeed=load_deepspeed_config(launch.deepspeed_config),
        **({"nodes": launch.nodes} if launch.nodes > 1 else {}),  # one node: the keys runs have always had
    )
    runs = sorted(
        (int(m.group(1) or 1), p) for p in root.glob(f"{key}*") if (m := re.fullmatch(rf"{key}(?:\.(\d+))?", p.name))
    )
    if runs and (resume or not any(runs[-1][1].iterdir())):
        return runs[-1][1]
    n = runs[-1][0] + 1 if runs else 1
    return root / (key if n == 1 else f"{key}.{n}")


def _point_latest(folder: Path) -> None:
    """training/latest -> folder, replaced atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    link, tmp = folder.parent / LATEST, folder.parent / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(folder.name)
    os.replace(tmp, link)


@task(name=TRAINING, retries=1, retry_delay_seconds=5, retry_condition_fn=_processes_failed)
def training_task(
    plan: StagePlan, data: str, launch: LaunchConfig, tracking: TrackingConfig, run: bool = True, resume: bool = True
) -> TrainingResult:
    """The stage in a flow; a retry (only when the processes died) resumes from the newest checkpoint."""
    return training_stage(plan, data, launch, tracking, run, resume, get_run_logger().info, progress_artifact(TRAINING))
