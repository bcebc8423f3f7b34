"""Jacobi Forcing as a plain library: decoding, trajectories, packing, losses, evaluation.

Depends on torch and transformers only (no orchestration or tracking imports),
so every piece can be used from a notebook. The names below load on first use, so
that `jfcore.environment` and `jfcore.config` import without torch (the environment
must be set before transformers is imported: huggingface_hub reads it once).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ConfigError": "jfcore.config",
    "DecodeConfig": "jfcore.decoding",
    "DecodeOutput": "jfcore.decoding",
    "DecodeStats": "jfcore.decoding",
    "decode": "jfcore.decoding",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jfcore' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
