"""`jf-train --config RECIPE`: the training stage alone (tasks/training.py; docs/TRAINING.md)."""

from __future__ import annotations

import dataclasses
import json

from cli.stage import stage_main
from jfcore.config import ConfigError
from jfcore.models import ModelLoadError
from jfcore.training.config import TrainConfig
from jfcore.training.data import TrainingDataError
from tasks.tracking import TrackingConfig
from tasks.training import LaunchConfig, TrainingFailed, run_training

SECTIONS = {"training": TrainConfig, "launch": LaunchConfig, "tracking": TrackingConfig}


def main(argv: list[str] | None = None) -> None:
    """jf-train --config RECIPE: run (or resume) the training stage alone."""
    result = stage_main(
        argv,
        "Distill a model on packed Jacobi trajectories with DeepSpeed.",
        SECTIONS,
        lambda c: run_training(c["training"], c["launch"], c["tracking"]),
        (ConfigError, TrainingDataError, ModelLoadError, TrainingFailed),
    )
    print(json.dumps(dataclasses.asdict(result), indent=2, default=str))


if __name__ == "__main__":
    main()
