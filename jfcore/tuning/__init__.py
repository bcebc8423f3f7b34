"""Tuning the decoding for a machine: cost curve, acceptance, predicted speedups, confirmation (docs/DESIGN.md, 12)."""
