"""Run a command; stop it and every process under it when told to (SIGTERM) or when its launcher dies.

    python -m tasks.launch_guard CMD [ARGS...]

torchrun starts each rank in a session of its own, so killing torchrun's process group leaves the ranks
training on, and a launcher that is cancelled or killed (SIGTERM, SIGKILL) would orphan the whole job.
The guard sits between the launcher and the job. On SIGTERM, or once its parent is gone, it asks the
command to stop (SIGTERM: torchrun passes it to the ranks), waits a grace period, then SIGKILLs every
process still under it. Otherwise it waits and exits with the command's status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

GRACE_S = 30.0


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux /proc; elsewhere only what its process group holds)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(proc: subprocess.Popen) -> None:
    tree = descendants(proc.pid)  # before the command exits and its children are re-parented away
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=GRACE_S)
    for pid in [proc.pid, *tree, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def main() -> None:
    parent = os.getppid()
    proc = subprocess.Popen(sys.argv[1:])
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while True:
        try:
            code = proc.wait(timeout=0.5)
            sys.exit(code if code >= 0 else 128 - code)
        except subprocess.TimeoutExpired:
            if stopping or os.getppid() != parent:  # told to, or re-parented: the launcher is gone
                stop(proc)
                sys.exit(143)


if __name__ == "__main__":
    main()
