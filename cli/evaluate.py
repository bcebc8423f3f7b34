"""`jf-eval --config RECIPE`: the evaluation stage alone (tasks/evaluation.py; docs/EVALUATION.md)."""

from __future__ import annotations

from cli.stage import stage_main
from jfcore.config import ConfigError
from jfcore.evaluation.config import EvalConfig
from jfcore.evaluation.isolation import IsolationUnavailable
from jfcore.models import ModelLoadError
from tasks.evaluation import run_evaluation
from tasks.ray_workers import RayConfig
from tasks.tracking import TrackingConfig

SECTIONS = {"evaluation": EvalConfig, "ray": RayConfig, "tracking": TrackingConfig}


def main(argv: list[str] | None = None) -> None:
    """jf-eval --config RECIPE: run (or resume) the evaluation stage alone."""
    result = stage_main(
        argv,
        "Evaluate models on HumanEval, MBPP, GSM8K and MATH-500.",
        SECTIONS,
        lambda c: run_evaluation(c["evaluation"], c["ray"], c["tracking"]),
        (ConfigError, ModelLoadError, FileNotFoundError, IsolationUnavailable),
    )
    print(f"\nreport: {result.report}" + (f"\nMLflow run: {result.mlflow_run_id}" if result.mlflow_run_id else ""))


if __name__ == "__main__":
    main()
