"""Fixed-shape decode forwards: compiled with torch.compile (inductor), or replayed from CUDA graphs.

Both need shapes that repeat, so the slot batch pads queries to powers of two and reads the cache in whole
granules (jfcore/decoding/runner/slots.py, `SlotCache.fixed_shape`); the first forward, the prefill, stays eager.

Inductor with frozen weights folds the weights into the graph as constants, so it can prepack them for its matrix
kernels: on a CPU that is what keeps a forward over q positions close to one over a single position (batch-1
decoding is memory-bound; eager kernels repack the weights every call). Each new shape compiles once per process
(`bench/compile_curve.py` measures both). Frozen weights are constants: a model whose weights change after
compiling (training) needs a fresh compile. CUDA graphs: jfcore/decoding/runner/graphs.py.
"""

from __future__ import annotations

import weakref

import torch

from jfcore.decoding.runner.graphs import graph_forward
from jfcore.decoding.runner.kv_cache import SlotCache, shape_bucket
from jfcore.decoding.runner.slots import FixedForward

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_forward(model: torch.nn.Module) -> torch.nn.Module:
    """`model` compiled for decoding (cached: every decoder of this model shares the compiled graphs)."""
    if model not in _COMPILED:
        import torch._dynamo.config as dynamo_config

        # One graph per shape (query width, cache granules, batch size): allow many before falling back to eager.
        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
        _COMPILED[model] = torch.compile(model, dynamic=False, options={"freezing": True})
    return _COMPILED[model]


class InductorForward:
    """Decode forwards through `compiled_forward(model)`, at the shapes the slot batch pads to, with rows padded to
    a bucket as well (`shape_bucket`: a batch whose rows come and go meets few shapes; padding rows compute on
    zeros in cache rows no real row reads, and are dropped)."""

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module | None = None):
        """`module`: what runs the forwards (default: `model` compiled; the tests pass the eager model)."""
        self.module = compiled_forward(model) if module is None else module

    def __call__(self, cache: SlotCache, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens, mask = inputs["input_ids"], inputs["attention_mask"]
        rows, width = tokens.shape
        padded = shape_bucket(rows)
        if padded > rows:
            inputs = {k: torch.cat([v, v.new_zeros((padded - rows, *v.shape[1:]))]) for k, v in inputs.items()}
        write_at = torch.empty(width, dtype=torch.long, device=tokens.device)
        with cache.fixed_shape(width, mask.shape[-1], padded, write_at):
            return self.module(**inputs, past_key_values=cache, use_cache=True).logits[:rows]


def fixed_forward(model: torch.nn.Module, compile: str) -> FixedForward | None:
    """What runs `model`'s decode forwards for a `DecodeConfig.compile` setting (None: eager)."""
    if compile == "auto":
        compile = "cuda_graphs" if next(model.parameters()).device.type == "cuda" else "off"
    if compile == "inductor":
        return InductorForward(model)
    if compile == "cuda_graphs":
        return graph_forward(model)
    return None
