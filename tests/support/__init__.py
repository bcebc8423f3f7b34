"""Helpers the unit and integration suites share: tiny models, real servers, training data, the flow stack."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
