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


__all__ = ["get_run_logger", "task"]
