"""Prefect where it is installed. Without it (a bare GPU box with only torch and transformers) the decorators
leave plain functions, so the flow and its stage tasks run unchanged as Python calls, logging to the
`jacobi_forcing` logger, and the stage CLIs (`jf-train`, `jf-eval`, `jf-tune`) run too
(docs/PIPELINE.md, "Without servers, stage by stage")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace

try:
    from prefect import flow, get_run_logger, runtime, task

    PREFECT = True
except ModuleNotFoundError:
    PREFECT = False

    def task(*args, **kwargs) -> Callable:
        def plain(function: Callable) -> Callable:
            function.with_options = lambda **options: function  # a renamed task is the same function
            return function

        return plain(args[0]) if args and callable(args[0]) else plain

    flow = task
    runtime = SimpleNamespace(flow_run=SimpleNamespace(name=None, id=None))

    def get_run_logger() -> logging.Logger:
        return logging.getLogger("jacobi_forcing")


Progress = Callable[..., None]  # (done, total, note=None) of a long stage's work; the note: its latest figures


def progress_artifact(stage: str) -> Progress | None:
    """A Prefect progress artifact (`<stage>-progress`, in the flow run's Artifacts tab), updated with (done, total)
    and a note for its description (training: the latest held-out acceptance). Made at the first report, so a stage
    that had nothing to do shows none. None without Prefect."""
    if not PREFECT:
        return None
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    artifact = None

    def update(done: int, total: int, note: str | None = None) -> None:
        nonlocal artifact
        percent = 100.0 * done / max(total, 1)
        description = f"{stage}: work done" + (f"; {note}" if note else "")
        if artifact is None:
            artifact = create_progress_artifact(percent, key=f"{stage}-progress", description=description)
        else:
            update_progress_artifact(artifact, percent, description=description if note else None)

    return update


def markdown_artifact(markdown: str, key: str, description: str) -> None:
    """A Markdown artifact of the flow run (its Artifacts tab); nothing without Prefect."""
    if PREFECT:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(markdown, key=key, description=description)


__all__ = ["Progress", "flow", "get_run_logger", "markdown_artifact", "progress_artifact", "runtime", "task"]
