"""A KV cache written in place: storage allocated ahead, a length that moves.

transformers' `DynamicCache` grows by concatenation, so every forward copies the whole cache of every layer; at
batch 64 that copy costs as much as a small model's forward. `SlotCache` keeps each full-attention layer's keys
and values in storage with room to spare ([batch, heads, capacity, head_dim]); a forward writes its new slots in
place and attention reads a view of the used part. Dropping rejected draft slots moves the length back (`crop`),
squeezing holes out gathers in place, and storage grows by doubling, so the copies are rare.

For a compiled forward the shapes must repeat and nothing the graph reads may change every step: `fixed_shape`
makes every layer write its slots at a position tensor (not the Python length) and return a view of a fixed
number of slots (a bucket); the caller masks the slots past the length.

It goes through the public cache interface only: a `DynamicCache` whose full-attention layers are `SlotLayer`s
(a `DynamicLayer` subclass); other layer kinds (sliding window, ...) keep transformers' own classes.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GRANULE = 256  # slots: storage grows in whole multiples of this


def granules(slots: int) -> int:
    """`slots` rounded up to whole granules."""
    return -(-slots // GRANULE) * GRANULE


class SlotLayer(DynamicLayer):
    """One layer's keys and values in preallocated storage; `keys`/`values` are views of the used slots."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.length = 0
        self.write_at: torch.Tensor | None = None  # fixed-shape mode: slot indices of the next write
        self.view_slots = 0  # fixed-shape mode: slots every read returns

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._k = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self._v = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        self.length = 0
        self.is_initialized = True
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.write_at is not None:
            self._k.index_copy_(2, self.write_at, key_states)
            self._v.index_copy_(2, self.write_at, value_states)
            return self._k[:, :, : self.view_slots], self._v[:, :, : self.view_slots]
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self._k = self._v = None
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of slots to drop as a negative integer")
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.set_slots(self.keys[indices], self.values[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.set_slots(self.keys.repeat_interleave(repeats, 0), self.values.repeat_interleave(repeats, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def reserve(self, slots: int) -> None:
        """Room for `slots` slots, growing storage to at least double (one copy of the used part)."""
        if slots <= self._k.shape[2]:
            return
        capacity = granules(max(slots, 2 * self._k.shape[2]))
        for name in ("_k", "_v"):
            old = getattr(self, name)
            # Zeros, not garbage: a fixed-shape read covers slots never written, and a NaN there would poison
            # attention even under the mask (NaN + -inf is NaN).
            new = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def set_slots(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the used slots with `keys`/`values` [batch, heads, slots, head_dim] (new storage if the
        batch size changed, else written in place)."""
        if keys.shape[0] != self._k.shape[0]:
            self._k = keys.new_zeros((*keys.shape[:2], max(keys.shape[2], GRANULE), keys.shape[3]))
            self._v = values.new_zeros(self._k.shape)
        self.length = 0
        self.reserve(keys.shape[2])
        self._k[:, :, : keys.shape[2]] = keys
        self._v[:, :, : values.shape[2]] = values
        self.length = keys.shape[2]
        self._views()

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]


class SlotCache(DynamicCache):
    """`DynamicCache` for `config` with every plain full-attention layer kept in place (`SlotLayer`)."""

    def __init__(self, config):
        super().__init__(config=config)
        if self.layers:
            self.layers = [SlotLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        else:  # a config transformers cannot read layer types from: layers are made as the model asks
            self.layer_class_to_replicate = SlotLayer

    @contextlib.contextmanager
    def fixed_shape(self, new_slots: int, view_slots: int, device: torch.device):
        """Inside: every layer writes the next `new_slots` slots at a position tensor and reads `view_slots` slots
        (storage reserved for them); after: the lengths count the new slots."""
        start = self.layers[0].length
        write_at = torch.arange(start, start + new_slots, device=device)
        for layer in self.layers:
            layer.reserve(view_slots)
            layer.write_at, layer.view_slots = write_at, view_slots
        try:
            yield
        finally:
            for layer in self.layers:
                layer.write_at = None
                layer.length = start + new_slots
                layer._views()

    @property
    def in_place(self) -> bool:
        """Whether every layer is a `SlotLayer` (whose slots the batch may rearrange)."""
        return bool(self.layers) and all(isinstance(layer, SlotLayer) and layer.is_initialized for layer in self.layers)
