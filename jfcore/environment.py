"""Every environment default the project sets or reads, in one place: where its files go, how many cores it may
use, and the quiet, offline-safe settings its processes run with (docs/PIPELINE.md, "Environment").

Each default yields to a value the environment already has, so a user's setting always wins.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

CACHE_DIR = "JF_CACHE_DIR"  # converted models, fetched registry versions, DeepSpeed's JIT builds
SHARED_DATA = "JF_SHARED_DATA"  # the benchmark and prompt files

# No usage reports from Ray, Prefect or MLflow, Ray without token auth (2.60 turns it on by default), and no
# tokenizer thread pools competing with the workers for cores.
QUIET = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Nothing waits on the Hugging Face hub: models and data are local (set them to 0 to let recipes name hub ids).
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def cache_dir() -> Path:
    """`$JF_CACHE_DIR`, else ~/.cache/jacobi-forcing."""
    return Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "jacobi-forcing").expanduser()


def shared_data_dir() -> Path:
    """`$JF_SHARED_DATA`, else `shared/data` beside the repository (`<repo>/../shared/data`)."""
    env = os.environ.get(SHARED_DATA)
    return Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container or `taskset` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def threads_per_process(processes: int) -> int:
    """CPU threads for each of `processes` processes sharing this machine's usable cores."""
    return max(1, usable_cores() // max(1, processes))


def defaults(offline: bool = True) -> dict[str, str]:
    """The quiet (and, by default, offline) settings and the cache folder, each as the environment has it if set."""
    wanted = QUIET | (OFFLINE if offline else {}) | {CACHE_DIR: str(cache_dir())}
    return {key: os.environ.get(key, value) for key, value in wanted.items()}


def apply_defaults(offline: bool = False) -> None:
    """Set in this process (and so in what it starts) every default the environment lacks."""
    for key, value in defaults(offline).items():
        os.environ.setdefault(key, value)
