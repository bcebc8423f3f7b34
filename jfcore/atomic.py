"""Atomic file writes: a crash never leaves a half-written file under the final name."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp)` on a hidden temp file beside `path`, then rename it into place.

    The temp name is `.<name>.<pid>.tmp`, so leftovers of a killed writer are easy to find.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
