"""One run per work folder: an exclusive lock that a second run waits for, then refuses with a clear message.

The lock is `flock` on `<folder>/.lock`, so it goes with the process that holds it: a killed run never
leaves a stale lock behind. The file names the holder, for the message the waiting run prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK = ".lock"


class FolderBusy(RuntimeError):
    """Another run held the folder for longer than this one was willing to wait."""


@contextlib.contextmanager
def folder_lock(folder: Path, holder: str, wait_s: float, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold `folder`'s lock for the body; wait up to `wait_s` seconds for another holder to let go."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    with open(path, "a+") as f:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                other = _holder(path)
                if time.monotonic() >= deadline:
                    raise FolderBusy(
                        f"{folder} is in use by {other}; waited {wait_s:.0f} s. Run again when it "
                        "has finished, or give this run another work_dir"
                    ) from None
                if not said:
                    log(f"waiting for {other} to finish with {folder} (up to {wait_s:.0f} s)")
                    said = True
                time.sleep(1)
        f.seek(0)
        f.truncate()
        f.write(
            json.dumps(
                {
                    "holder": holder,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
            )
        )
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"{info['holder']} (pid {info['pid']} on {info['host']}, since {info['since']})"
    except (OSError, ValueError, KeyError):
        return "another run"
