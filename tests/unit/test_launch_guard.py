"""The launch guard ends a job's whole session when its launcher dies, and passes its status on otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jfcore.hostspeed import scaled
from tests.support import REPO

GUARD = [sys.executable, "-m", "tasks.launch_guard"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"


def test_status_passes_through():
    assert subprocess.run([*GUARD, sys.executable, "-c", "raise SystemExit(3)"], cwd=REPO, check=False).returncode == 3
    assert subprocess.run([*GUARD, sys.executable, "-c", "pass"], cwd=REPO, check=False).returncode == 0


def test_a_killed_launcher_takes_the_job_down(tmp_path):
    """The launcher starts the guarded job in a session of its own (as the training stage does), then is killed."""
    pid_file = tmp_path / "job.pid"
    job_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    launch_code = (
        f"import subprocess, time\nsubprocess.Popen({[*GUARD, sys.executable, '-c', job_code]!r}, "
        "start_new_session=True)\ntime.sleep(120)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", launch_code], cwd=REPO)
    deadline = time.time() + scaled(30)
    while not (pid_file.is_file() and pid_file.read_text()):
        assert time.time() < deadline, "the job did not start"
        time.sleep(0.2)
    job = int(pid_file.read_text())
    assert alive(job)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + scaled(10)
    while alive(job):
        assert time.time() < deadline, "the job outlived its launcher"
        time.sleep(0.2)


def test_a_killed_compile_lock_is_cleared_and_a_live_one_kept(tmp_path):
    """torch waits forever on the lock a killed DeepSpeed op build leaves; a fresh lock may be a build in progress."""
    from tasks.training import STALE_BUILD_LOCK_S, clear_stale_build_locks

    stale, live = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(stale, (old, old))
    said: list[str] = []
    clear_stale_build_locks(tmp_path, said.append)
    assert not stale.exists() and live.exists()
    assert len(said) == 1 and str(stale) in said[0]
