"""The compiled decode forward: torch.compile (inductor) with frozen weights, one per model per process.

Freezing folds the weights into the graph as constants, so inductor can prepack them for its matrix kernels:
on a CPU that is what keeps a forward over q positions close to one over a single position (batch-1 decoding
is memory-bound; eager kernels repack the weights every call). Compiled code is specialised to shapes, so the
slot batch pads queries to powers of two and reads the cache in whole granules (jfcore/decoding/slots.py): a
decode meets a handful of shapes, each compiled once (`bench/compile_curve.py` measures both).

Frozen weights are constants: a model whose weights change after compiling (training) needs a fresh compile.
"""

from __future__ import annotations

import weakref

import torch

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_forward(model: torch.nn.Module) -> torch.nn.Module:
    """`model` compiled for decoding (cached: every decoder of this model shares the compiled graphs)."""
    if model not in _COMPILED:
        import torch._dynamo.config as dynamo_config

        # One graph per shape (query width, cache granules, batch size): allow many before falling back to eager.
        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
        _COMPILED[model] = torch.compile(model, dynamic=False, options={"freezing": True})
    return _COMPILED[model]
