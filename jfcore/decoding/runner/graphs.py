"""Decode forwards replayed from CUDA graphs, one graph per shape bucket (docs/DESIGN.md, section 1).

On a GPU a small model's forward is a few hundred kernel launches whose Python and launch overhead costs more than
the kernels themselves; a CUDA graph replays all of them with one call. A graph bakes in its shapes and the
addresses of everything it reads and writes, so:

- shapes come in buckets: rows and the query width (the slot batch) padded to a power of two or 1.5 times one
  (`shape_bucket`), the cache read in whole granules. A bucket's graph is captured the first time it is met: one
  eager warm-up forward on a side stream, then the capture, then the replay that computes the step;
- inputs are copied into static buffers each step (tokens, positions, the additive mask, the cache write
  positions), and the logits come back in the graph's own output buffer, valid until the next forward;
- the KV cache's storage must stay put: `SlotCache` keeps rows' storage when rows leave and has room for a
  padded batch, and when any storage is reallocated (the cache grows, more rows join) `storage_key` changes and
  every graph captured on the old storage is dropped;
- one runner serves every decode of a model (`graph_forward`), and a new decode's cache moves into the storage
  the graphs were captured on once the cache that used it is gone (`SlotCache.adopt`), so a run of short
  decodes (an evaluation, one prompt at a time) captures its graphs once, not once per decode.

Padding rows compute on stale inputs and cache rows that no real row reads; their outputs are discarded. Rows are
independent in every layer of a decoder-only model, so they cannot change a real row's logits.

`capture=False` keeps all of this but runs the forward eagerly on the static buffers instead of replaying a
graph: the CPU tests use it to check the bucketing, buffers and invalidation token for token.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from jfcore.config import ConfigError
from jfcore.decoding.runner.kv_cache import SlotCache, shape_bucket


@dataclass
class _Bucket:
    inputs: dict[str, torch.Tensor]  # static input buffers, bucket-sized
    write_at: torch.Tensor  # static cache write positions
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output buffer


_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_forward(model: torch.nn.Module) -> GraphForward:
    """The CUDA-graph runner of `model` (one per model: every decoder of it shares the graphs)."""
    if model not in _RUNNERS:
        _RUNNERS[model] = GraphForward(model)
    return _RUNNERS[model]


class GraphForward:
    """Decode forwards of `model` through CUDA graphs, captured per (rows, width, cache slots) bucket."""

    def __init__(self, model: torch.nn.Module, capture: bool = True):
        self.model = model
        self.device = next(model.parameters()).device
        if capture and self.device.type != "cuda":
            raise ConfigError(
                f"compile='cuda_graphs' needs the model on a CUDA device, and it is on {self.device}: "
                "use compile='inductor' (CPU) or 'off'"
            )
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.storage: tuple[int, ...] | None = None  # the cache storage the graphs were captured on
        self.owner: Callable[[], SlotCache | None] = lambda: None  # the cache using that storage (a weak reference)
        self.store: tuple | list = []  # that storage (SlotCache.storage)
        self.captures = 0  # graphs captured so far (each costs a warm-up forward and a capture)
        self.adoptions = 0  # caches moved into the graphs' storage

    def __call__(self, cache: SlotCache, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits [rows, width, vocab] of one decode forward; a view of the graph's output buffer."""
        tokens, mask = inputs["input_ids"], inputs["attention_mask"]
        rows, width = tokens.shape
        padded = shape_bucket(rows)
        key = (padded, width, mask.shape[-1])
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self._buffers(padded, inputs)
        for name, value in inputs.items():
            bucket.inputs[name][:rows].copy_(value, non_blocking=True)
        self.buckets[key] = bucket
        if self.owner() is not cache:  # a new cache: move it into the graphs' storage if that is free
            if self.owner() is None and cache.adopt(self.store):
                self.adoptions += 1
            self.owner = weakref.ref(cache)
        with cache.fixed_shape(width, mask.shape[-1], padded, bucket.write_at):
            if cache.storage_key != self.storage:  # other storage: graphs captured on the old one are stale
                for stale in self.buckets.values():
                    stale.graph = stale.logits = None
                if self.capture:  # a pool whose graphs are all gone cannot take new captures
                    self.pool = torch.cuda.graph_pool_handle()
                self.storage, self.store = cache.storage_key, cache.storage()
            if not self.capture:
                return self._forward(cache, bucket)[:rows]
            if bucket.graph is None:
                self._capture(cache, bucket)
            bucket.graph.replay()
        return bucket.logits[:rows]

    def _buffers(self, rows: int, inputs: dict[str, torch.Tensor]) -> _Bucket:
        static = {name: value.new_zeros((rows, *value.shape[1:])) for name, value in inputs.items()}
        width = inputs["input_ids"].shape[1]
        return _Bucket(static, torch.zeros(width, dtype=torch.long, device=self.device))

    def _forward(self, cache: SlotCache, bucket: _Bucket) -> torch.Tensor:
        return self.model(**bucket.inputs, past_key_values=cache, use_cache=True).logits

    def _capture(self, cache: SlotCache, bucket: _Bucket) -> None:
        # Warm up on a side stream (lazy initialisation and allocator state must not happen during capture); it
        # writes the same keys and values the replay will.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(cache, bucket)
        torch.cuda.current_stream().wait_stream(side)
        bucket.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bucket.graph, pool=self.pool):
            bucket.logits = self._forward(cache, bucket)
        self.captures += 1
