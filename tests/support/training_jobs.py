"""Watching a real training job: its loss curve, its rank processes, and killing one of them mid-run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from jfcore.hostspeed import scaled

CURVE = ("loss", "ar_loss", "consistency_loss", "copy_loss", "repeat_loss", "grad_norm", "learning_rate")


def curve(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def rank_processes(launch_file: Path) -> dict[int, int]:
    """{rank: pid} of the training processes started for `launch_file`."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if b"tasks.train_worker" not in cmdline or str(launch_file).encode() not in cmdline:
                continue
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
            if b"LOCAL_RANK" in env:
                ranks[int(env[b"RANK"])] = int(proc.name)
        except (OSError, ValueError):
            continue
    return ranks


def kill_rank_1_at(output_dir: Path, step: int) -> tuple[threading.Thread, list[int]]:
    """A started thread that SIGKILLs rank 1 of the job in `output_dir` (or in the one run folder under it)
    once checkpoint `step` is complete."""
    pattern = f"**/checkpoints/step-{step:07d}/jf_complete.json"
    killed: list[int] = []

    def kill() -> None:
        deadline = time.time() + scaled(900)
        while not (found := list(output_dir.glob(pattern))) and time.time() < deadline:
            time.sleep(0.05)
        pid = rank_processes(found[0].parents[2] / "launch.json").get(1) if found else None
        if pid:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread, killed
