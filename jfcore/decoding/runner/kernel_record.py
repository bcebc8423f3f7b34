"""The linear layers' kernel choices, measured once per machine and kept (docs/DESIGN.md, "Linear layers on a CPU").

The two ways of a product (jfcore/decoding/runner/linear.py) round differently in the last bits, which can flip a greedy
token where two logits tie to rounding. Timed afresh in every process, the choice, and with it such a token,
could differ between two runs of the same command. So each choice is measured once on this machine with this
torch, then kept in `$JF_CACHE_DIR/kernels/<machine>.json`, and every later process computes the way recorded.
Processes deciding at once take turns on a lock file, so a key is measured once and each reads the other's
choice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from jfcore.atomic import atomic_write
from jfcore.environment import cache_dir, cpu_model, usable_cores


def machine_key() -> dict:
    """What a kernel timing depends on besides the product's shape and threads: the CPU, the cores and torch."""
    return {"cpu": cpu_model(), "cores": usable_cores(), "torch": torch.__version__}


class KernelRecord:
    """Kernel choices by key (a product's weight shape, row bucket and threads), read from and written to `path`."""

    def __init__(self, path: Path):
        self.path = path
        self.choices: dict[str, object] = self._read()

    def _read(self) -> dict[str, object]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return dict(data["choices"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):  # a torn or foreign file: measure again
            return {}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def decide(self, key: str, measure: Callable[[], object]) -> object:
        """The recorded choice for `key`; else (another process may have recorded it meanwhile) `measure()`'s,
        recorded."""
        if key in self.choices:
            return self.choices[key]
        with self._locked():
            self.choices = self._read() | self.choices
            if key not in self.choices:
                self.choices[key] = measure()
                data = {"machine": machine_key(), "choices": dict(sorted(self.choices.items()))}
                atomic_write(self.path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))
        return self.choices[key]


_RECORDS: dict[Path, KernelRecord] = {}


def this_machines_record() -> KernelRecord:
    """This machine's record under the cache folder (one object per process and path)."""
    digest = hashlib.sha256(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{digest}.json"
    if path not in _RECORDS:
        _RECORDS[path] = KernelRecord(path)
    return _RECORDS[path]
