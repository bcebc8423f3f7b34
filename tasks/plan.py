"""What one (curriculum) stage of the pipeline trains: the input of the trajectories, packing and training tasks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from jfcore.config import replace_checked
from jfcore.models import ModelConfig
from jfcore.packing import PackingConfig
from jfcore.prompts import PromptSource
from jfcore.training.config import TrainConfig
from jfcore.trajectories import TrajectoryConfig


@dataclass(frozen=True)
class StagePlan:
    name: str  # the curriculum stage's name (its folder), or "training" without a curriculum
    label: str  # added to its MLflow run names and log lines: the curriculum stage's name, or ""
    folder: Path  # the stage folders (trajectories/, packing/, training/) are under it
    model: ModelConfig  # the model it decodes trajectories with and trains from
    prompts: PromptSource
    trajectories: TrajectoryConfig
    packing: PackingConfig
    training: TrainConfig  # its data and output_dir are filled in by the training stage
    anchor: str | None = None  # the earlier stage whose trajectories' text gives this one's fixed points

    def path(self, stage: str) -> Path:
        return self.folder / stage

    def run_name(self, stage: str) -> str:
        return f"{stage} ({self.label})" if self.label else stage

    def starting_from(self, model: ModelConfig) -> StagePlan:
        """This stage with trajectories decoded by, and training starting from, `model` (a curriculum stage: the
        previous stage's export)."""
        return replace(self, model=model, training=replace_checked(self.training, model=training_model(model)))


def training_model(model: ModelConfig) -> ModelConfig:
    """Training keeps float32 master weights, whatever the model's dtype; TrainConfig.precision sets the compute."""
    return replace(model, dtype="float32")
