"""Atomic, durable file writes: a crash never leaves a half-written file under the final name,
and a power loss never leaves a name that points at data still only in the page cache."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp)` on a hidden temp file beside `path`, flush it to disk, then rename it into place.

    The temp name is `.<name>.<pid>.tmp`, so leftovers of a killed writer are easy to find.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        fsync_file(tmp)  # before the rename: else the new name may outlive a power loss while its data does not
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself lives in the folder
    finally:
        tmp.unlink(missing_ok=True)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # any descriptor flushes the file's dirty pages, whoever wrote them
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (names created, renamed or removed in it); a no-op where the platform refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems reject fsync on a folder (EINVAL); their renames are durable anyway
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder`, and `folder` itself, before something points at them."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            fsync_file(Path(root) / name)
        for name in dirs:
            fsync_dir(Path(root) / name)
    fsync_dir(folder)
