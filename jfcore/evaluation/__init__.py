"""Evaluation: answer extraction and scoring for the benchmarks."""
