"""Jacobi Forcing as a plain library: decoding, trajectories, packing, losses, evaluation.

Depends on torch and transformers only (no orchestration or tracking imports),
so every piece can be used from a notebook.
"""

from jfcore.config import ConfigError
from jfcore.decoding import DecodeConfig, DecodeOutput, DecodeStats, decode

__all__ = ["ConfigError", "DecodeConfig", "DecodeOutput", "DecodeStats", "decode"]
