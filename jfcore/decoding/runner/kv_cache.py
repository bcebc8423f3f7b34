"""A KV cache written in place: storage allocated ahead, a length that moves.

transformers' `DynamicCache` grows by concatenation, so every forward copies the whole cache of every layer; at
batch 64 that copy costs as much as a small model's forward. `SlotCache` keeps each full-attention layer's keys
and values in storage with room to spare ([batch, heads, capacity, head_dim]); a forward writes its new slots in
place and attention reads a view of the used part. Dropping rejected draft slots moves the length back (`crop`),
squeezing holes out gathers in place, and storage grows by doubling, so the copies are rare. Every layer's storage
is a view of one tensor (`LayerStack`), so moving rows or slots is one operation for all layers.

For a compiled forward the shapes must repeat and nothing the graph reads may change every step: `fixed_shape`
makes every layer write its slots at a position tensor (not the Python length) and return a view of a fixed
number of slots (a bucket); the caller masks the slots past the length. A CUDA graph also bakes in addresses, so
storage keeps its rows when rows leave (only rows whose place changes are written) or join (written after the
used rows) and has room for a batch padded to a bucket; `storage_key` changes whenever any storage is
reallocated, which retires graphs captured on it.

It goes through the public cache interface only: a `DynamicCache` whose full-attention layers are `SlotLayer`s
(a `DynamicLayer` subclass); other layer kinds (sliding window, ...) keep transformers' own classes.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GRANULE = 256  # slots: fixed-shape reads, and storage past one granule, come in whole multiples of this
_ALLOCATIONS = itertools.count()  # storage ids, never reused (an address can be)


def granules(slots: int) -> int:
    """`slots` rounded up to whole granules."""
    return -(-slots // GRANULE) * GRANULE


def shape_bucket(n: int) -> int:
    """`n` rounded up to a power of two or one and a half times one (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ...):
    the fixed-shape forward's query widths and padded rows. Padding costs at most a third of a forward, not half as
    with powers of two alone (a multiblock step of 33-44 queries ran 64), for twice as many shapes."""
    power = 1 << (n - 1).bit_length()
    return 3 * power // 4 if n <= 3 * power // 4 else power


def capacity_for(slots: int) -> int:
    """Storage slots to allocate for `slots`: a power of two from 16 up to a granule, whole granules above (short
    decodes of many rows do not zero a granule per row; fixed-shape reads reserve whole granules anyway)."""
    return granules(slots) if slots > GRANULE else max(16, 1 << (slots - 1).bit_length())


class SlotLayer(DynamicLayer):
    """One layer's keys and values in preallocated storage; `keys`/`values` are views of the used slots."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._k: torch.Tensor | None = None  # [row capacity, heads, slot capacity, head_dim]
        self._v: torch.Tensor | None = None
        self.storage_id = -1
        self.rows = 0  # rows in use: the first `rows` of storage
        self.length = 0
        self.write_at: torch.Tensor | None = None  # fixed-shape mode: slot indices of the next write
        self.view_slots = 0  # fixed-shape mode: slots every read returns
        self.stack: LayerStack | None = None  # storage shared with the cache's other layers (see LayerStack)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.rows, self.length = key_states.shape[0], 0
        self.is_initialized = True
        if self.stack is None or not self.stack.join(self, key_states):
            self._allocate(key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3])))
            self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = key_states.shape[0]  # the rows in use, or (fixed shape) a bucket of them
        if self.write_at is not None:
            self._k[:rows].index_copy_(2, self.write_at, key_states)
            self._v[:rows].index_copy_(2, self.write_at, value_states)
            return self._k[:rows, :, : self.view_slots], self._v[:rows, :, : self.view_slots]
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        self._k[:rows, :, self.length : end] = key_states
        self._v[:rows, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        if self.stack is not None:
            self.stack.leave()
        self._k = self._v = None
        self.rows = self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of slots to drop as a negative integer")
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`, in that order. Only rows whose place changes are written: a batch whose leaving
        rows are filled by its last rows (jfcore/decoding/scheduler.py) copies those rows, not the batch."""
        if not self.is_initialized:
            return
        rows = len(indices)
        if rows > self._k.shape[0]:  # more rows than storage (repeated indices): gather into new storage
            self.set_slots(self.keys[indices], self.values[indices])
            return
        moved = (indices != torch.arange(rows, device=indices.device)).nonzero().squeeze(1)
        self.move_rows(moved, indices[moved], rows)

    def move_rows(self, target: torch.Tensor | None, source: torch.Tensor | None, rows: int) -> None:
        """Copy row `source[i]` to row `target[i]` (all read before any is written: a row may move into a place
        another row leaves), then keep the first `rows` rows. None: no row moves."""
        if not self.is_initialized:
            return
        if target is not None and len(target):
            self._k[target, :, : self.length] = self._k[source, :, : self.length]
            self._v[target, :, : self.length] = self._v[source, :, : self.length]
        self.rows = rows
        self._views()

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows [rows, heads, slots, head_dim] after the used ones, without moving those: the new rows' slots
        end where the used slots end (or move that end on, leaving the used rows' extra slots as holes for the
        caller's mask), so their slots right-align, like left padding."""
        rows, slots = self.rows + keys.shape[0], max(self.length, keys.shape[2])
        # room for a power of two of rows: joins rarely reallocate
        self.reserve(slots, 1 << (rows - 1).bit_length() if rows > self._k.shape[0] else 0)
        self._k[self.rows : rows, :, slots - keys.shape[2] : slots] = keys
        self._v[self.rows : rows, :, slots - keys.shape[2] : slots] = values
        self.rows, self.length = rows, slots
        self._views()

    def move_slots(self, rows: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy slot `source[i]` of row `rows[i]` to slot `target[i]` (all read before any is written)."""
        self._k[rows, :, target] = self._k[rows, :, source]
        self._v[rows, :, target] = self._v[rows, :, source]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.set_slots(self.keys.repeat_interleave(repeats, 0), self.values.repeat_interleave(repeats, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def reserve(self, slots: int, rows: int = 0) -> None:
        """Room for `slots` slots (and `rows` rows), growing storage to at least double (one copy of the used part)."""
        old_rows, _, old_slots, _ = self._k.shape
        if slots <= old_slots and rows <= old_rows:
            return
        if self.stack is not None:
            self.stack.reserve(slots, rows)
            return
        capacity = capacity_for(max(slots, 2 * old_slots)) if slots > old_slots else old_slots
        # Zeros, not garbage: a fixed-shape read covers slots never written, and a NaN there would poison
        # attention even under the mask (NaN + -inf is NaN).
        new = self._k.new_zeros((max(rows, old_rows), self._k.shape[1], capacity, self._k.shape[3]))
        new_v = torch.zeros_like(new)
        new[:old_rows, :, : self.length] = self._k[:, :, : self.length]
        new_v[:old_rows, :, : self.length] = self._v[:, :, : self.length]
        self._allocate(new, new_v)

    def set_slots(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make `keys`/`values` [rows, heads, slots, head_dim] the used slots, written into the front of the
        storage in place (new storage only for more rows or slots than it holds)."""
        rows, slots = keys.shape[0], keys.shape[2]
        if rows > self._k.shape[0] and self.stack is not None:
            self.stack.reserve(slots, 1 << (rows - 1).bit_length())
        elif rows > self._k.shape[0]:  # room for a power of two of rows: joins rarely reallocate
            self._allocate(
                keys.new_zeros((1 << (rows - 1).bit_length(), keys.shape[1], capacity_for(slots), keys.shape[3]))
            )
        self.length = 0
        self.reserve(slots)
        self._k[:rows, :, :slots] = keys
        self._v[:rows, :, :slots] = values
        self.rows, self.length = rows, slots
        self._views()

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, storage_id: int) -> None:
        """Move the used slots into `keys`/`values` (storage with room for them, no longer used by anyone else)
        and keep them as this layer's storage."""
        keys[: self.rows, :, : self.length] = self._k[: self.rows, :, : self.length]
        values[: self.rows, :, : self.length] = self._v[: self.rows, :, : self.length]
        self._k, self._v, self.storage_id = keys, values, storage_id
        self._views()

    def fits(self, keys: torch.Tensor) -> bool:
        """Whether storage like `keys` can hold this layer's used slots."""
        rows, heads, slots, dim = keys.shape
        same = (heads, dim, keys.dtype, keys.device) == (
            self._k.shape[1],
            self._k.shape[3],
            self._k.dtype,
            self._k.device,
        )
        return same and rows >= self.rows and slots >= self.length

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor | None = None) -> None:
        self._k, self._v = keys, (torch.zeros_like(keys) if values is None else values)
        self.storage_id = next(_ALLOCATIONS)

    def _views(self) -> None:
        self.keys = self._k[: self.rows, :, : self.length]
        self.values = self._v[: self.rows, :, : self.length]


class LayerStack:
    """Every full-attention layer's keys and values in one tensor each, [layers, rows, heads, slots, head_dim],
    each layer's storage a view of it (as one tensor holds every layer's KV blocks in engines built for speed).
    Moving rows or slots is then one indexing operation for all layers rather than one per layer: at SmolLM2-135M's
    30 layers, per-layer operations were most of a GPU decode step's host work. Storage grows for all layers at
    once. A layer whose heads, head size, dtype or device differ from the first layer's makes the layers keep
    storage of their own."""

    def __init__(self, layers: list[SlotLayer]):
        self.layers = layers
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.storage_id = -1
        for layer in layers:
            layer.stack = self

    @property
    def whole(self) -> bool:
        """Whether every layer is initialized and a view of the stack (so one operation moves them all)."""
        return self.k is not None and all(layer.stack is self and layer.is_initialized for layer in self.layers)

    def join(self, layer: SlotLayer, key_states: torch.Tensor) -> bool:
        """Make `layer` (initializing) a view of the stack; False if its shape does not fit (the stack dissolves)."""
        rows, heads, _, dim = key_states.shape
        if self.k is None:
            self.k = key_states.new_zeros((len(self.layers), rows, heads, 0, dim))
            self.v = torch.zeros_like(self.k)
            self.storage_id = next(_ALLOCATIONS)
        elif not self._holds(heads, dim, key_states):
            self.leave()
            return False
        self._point(self.layers.index(layer))
        return True

    def reserve(self, slots: int, rows: int = 0) -> None:
        """Room for `slots` slots and `rows` rows in every layer: one new tensor, the old one copied into it."""
        _, old_rows, heads, old_slots, dim = self.k.shape
        if slots <= old_slots and rows <= old_rows:
            return
        capacity = capacity_for(max(slots, 2 * old_slots)) if slots > old_slots else old_slots
        # Zeros, not garbage: a fixed-shape read covers slots never written (see SlotLayer.reserve).
        k = self.k.new_zeros((len(self.layers), max(rows, old_rows), heads, capacity, dim))
        v = torch.zeros_like(k)
        k[:, :old_rows, :, :old_slots] = self.k
        v[:, :old_rows, :, :old_slots] = self.v
        self.k, self.v, self.storage_id = k, v, next(_ALLOCATIONS)
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                self._point(i)

    def adopt(self, k: torch.Tensor, v: torch.Tensor, storage_id: int) -> bool:
        """Move into another stack's tensors (its cache is gone) if they hold this one's used rows and slots."""
        rows = max(layer.rows for layer in self.layers)
        slots = max(layer.length for layer in self.layers)
        layers, storage_rows, heads, storage_slots, dim = k.shape
        if layers != len(self.layers) or not self._holds(heads, dim, k) or storage_rows < rows or storage_slots < slots:
            return False
        k[:, :rows, :, :slots] = self.k[:, :rows, :, :slots]
        v[:, :rows, :, :slots] = self.v[:, :rows, :, :slots]
        self.k, self.v, self.storage_id = k, v, storage_id
        for i in range(len(self.layers)):
            self._point(i)
        return True

    def leave(self) -> None:
        """Stop sharing: each layer keeps its view as storage of its own (it grows on its own from now on)."""
        for layer in self.layers:
            layer.stack = None
        self.k = self.v = None

    def _holds(self, heads: int, dim: int, like: torch.Tensor) -> bool:
        """Whether keys of `heads` heads of size `dim`, with `like`'s dtype and device, are what the stack holds."""
        return (heads, dim, like.dtype, like.device) == (self.k.shape[2], self.k.shape[4], self.k.dtype, self.k.device)

    def _point(self, i: int) -> None:
        """Make layer `i`'s storage its view of the stack."""
        layer = self.layers[i]
        layer._k, layer._v, layer.storage_id = self.k[i], self.v[i], self.storage_id
        layer._views()


class SlotCache(DynamicCache):
    """`DynamicCache` for `config` with every plain full-attention layer kept in place (`SlotLayer`)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.stack: LayerStack | None = None
        if self.layers:
            self.layers = [SlotLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
            if all(isinstance(layer, SlotLayer) for layer in self.layers):
                self.stack = LayerStack(self.layers)
        else:  # a config transformers cannot read layer types from: layers are made as the model asks
            self.layer_class_to_replicate = SlotLayer

    @contextlib.contextmanager
    def fixed_shape(self, new_slots: int, view_slots: int, rows: int, write_at: torch.Tensor):
        """Inside: every layer writes the next `new_slots` slots at `write_at` (filled here; a device tensor of
        `new_slots` entries) and reads `view_slots` slots of `rows` rows (storage reserved for them); after: the
        lengths count the new slots."""
        start = self.layers[0].length
        write_at.copy_(torch.arange(start, start + new_slots), non_blocking=True)
        for layer in self.layers:
            layer.reserve(view_slots, rows)
            layer.write_at, layer.view_slots = write_at, view_slots
        try:
            yield
        finally:
            for layer in self.layers:
                layer.write_at = None
                layer.length = start + new_slots
                layer._views()

    def keep_rows(self, rows: list[int], device: torch.device) -> None:
        """`batch_select_indices` for indices the host holds: which rows move is worked out once for all layers
        (per layer, it reads the indices back from the device)."""
        storage_rows = [layer._k.shape[0] for layer in self.layers if layer.is_initialized]
        if not self.in_place or len(rows) > min(storage_rows, default=0):
            self.batch_select_indices(torch.tensor(rows, device=device))
            return
        moved = [i for i, row in enumerate(rows) if row != i]
        target = torch.tensor(moved, device=device) if moved else None
        source = torch.tensor([rows[i] for i in moved], device=device) if moved else None
        if self._stacked and moved:  # every layer at once (their lengths agree between forwards)
            length = self.layers[0].length
            self.stack.k[:, target, :, :length] = self.stack.k[:, source, :, :length]
            self.stack.v[:, target, :, :length] = self.stack.v[:, source, :, :length]
            target = None
        for layer in self.layers:
            layer.move_rows(target, source, len(rows))

    def move_slots(self, rows: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy slot `source[i]` of row `rows[i]` to slot `target[i]` in every layer (all read before any is
        written)."""
        if self._stacked:
            self.stack.k[:, rows, :, target] = self.stack.k[:, rows, :, source]
            self.stack.v[:, rows, :, target] = self.stack.v[:, rows, :, source]
            return
        for layer in self.layers:
            layer.move_slots(rows, source, target)

    def gather_slots(self, order: torch.Tensor) -> None:
        """Keep slots `order[b]` [B, width] of each row b, in that order, as its first `width` slots (every layer).
        Layer by layer even when stacked: on a CPU one gather over the stack's five dimensions took 2.5x as long
        as one per layer, and compaction is rare."""
        for layer in self.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.set_slots(torch.gather(layer.keys, 2, index), torch.gather(layer.values, 2, index))

    @property
    def _stacked(self) -> bool:
        return self.stack is not None and self.stack.whole

    def storage(self) -> tuple[torch.Tensor, torch.Tensor, int] | list[tuple[torch.Tensor, torch.Tensor, int]]:
        """The stack's storage (keys, values, id), or without one every layer's."""
        if self._stacked:
            return self.stack.k, self.stack.v, self.stack.storage_id
        return [(layer._k, layer._v, layer.storage_id) for layer in self.layers]

    def adopt(self, storage) -> bool:
        """Move into `storage` (what another cache's `storage()` gave; that cache is gone) if it fits; True if it
        did."""
        if isinstance(storage, tuple):
            return self._stacked and self.stack.adopt(*storage)
        if self._stacked or not storage:
            return False
        if len(storage) != len(self.layers) or not all(l.fits(k) for l, (k, _, _) in zip(self.layers, storage)):
            return False
        for layer, (keys, values, storage_id) in zip(self.layers, storage):
            layer.adopt(keys, values, storage_id)
        return True

    @property
    def storage_key(self) -> tuple[int, ...]:
        """Identifies every layer's storage: it changes whenever any layer reallocates."""
        return tuple(layer.storage_id for layer in self.layers)

    @property
    def in_place(self) -> bool:
        """Whether every layer is a `SlotLayer` (whose slots the batch may rearrange)."""
        return bool(self.layers) and all(isinstance(layer, SlotLayer) and layer.is_initialized for layer in self.layers)
