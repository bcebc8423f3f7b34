"""Prefect where it is installed. Without it the stage functions in `tasks` still import and run
(`bench.campaign` on a machine with only torch and transformers); the flow itself needs Prefect."""

from __future__ import annotations

import logging
from collections.abc import Callable

try:
    from prefect import get_run_logger, task
except ModuleNotFoundError:  # the decorated stage tasks stay plain functions

    def task(*args, **kwargs) -> Callable:
        if args and callable(args[0]):
            return args[0]
        return lambda function: function

    def get_run_logger() -> logging.Logger:
        return logging.getLogger("jacobi_forcing")


Progress = Callable[[int, int], None]  # (done, total) of a long stage's work


def progress_artifact(stage: str) -> Progress:
    """A Prefect progress artifact (`<stage>-progress`, in the flow run's Artifacts tab), updated with (done, total).
    Made at the first report, so a stage that had nothing to do shows none."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    artifact = None

    def update(done: int, total: int) -> None:
        nonlocal artifact
        percent = 100.0 * done / max(total, 1)
        if artifact is None:
            artifact = create_progress_artifact(percent, key=f"{stage}-progress", description=f"{stage}: work done")
        else:
            update_progress_artifact(artifact, percent)

    return update


__all__ = ["Progress", "get_run_logger", "progress_artifact", "task"]
