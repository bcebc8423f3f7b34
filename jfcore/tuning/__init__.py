"""Tuning the decoding for a machine: cost curve, acceptance, predicted speedups, confirmation (docs/DESIGN.md, 12)."""

from jfcore.tuning.tuner import TuneConfig, TuneResult, run_tune

__all__ = ["TuneConfig", "TuneResult", "run_tune"]
