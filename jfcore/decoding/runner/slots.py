"""A ragged batch of sequences sharing one KV cache.

Rows accept different numbers of draft tokens per forward, but a cache has
one length for the whole batch. So every row owns the same number of cache
*slots*, and a boolean `valid[b, s]` says which slots hold row b's committed
tokens (in order). Left padding and the KV of rejected draft tokens are
invalid slots ("holes"): they are masked out through the ordinary 2D
attention mask, and each token carries its true `position_ids`, so attention
over a row's valid slots is exactly attention over its committed text. Holes
are squeezed out when they would waste much memory. The bookkeeping lives on
the host, so it costs no device sync.

Only the public transformers API is used: a cache (`SlotCache`, a
`DynamicCache` whose layers are written in place), its `crop` and
`batch_select_indices`, a 2D attention mask (or a 4D additive mask for tree
verification) and explicit `position_ids`. The host mask has room to spare
too, so a step appends nothing by concatenation.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from jfcore.decoding.runner.head import split_head
from jfcore.decoding.runner.kv_cache import GRANULE, SlotCache, granules, shape_bucket
from jfcore.decoding.runner.linear import FasterLinear
from jfcore.decoding.runner.shared_prefix import Prefix, PrefixRows, use_wrapper

FixedForward = Callable[[SlotCache, dict[str, torch.Tensor]], torch.Tensor]  # (cache, inputs) -> logits


class SlotBatch:
    def __init__(
        self,
        model: torch.nn.Module,
        batch_size: int,
        compact: bool = True,
        fixed_forward: FixedForward | None = None,
        linear: FasterLinear | None = None,
    ):
        """`fixed_forward`: runs decode forwards at fixed shapes (compiled, or CUDA graphs:
        jfcore/decoding/runner/compiled.py): the query width padded to a bucket (`shape_bucket`) and the cache read in
        whole granules (the first forward, the prefill, stays eager: prompts have any length). `linear`: the mode
        eager forwards run under (jfcore/decoding/runner/linear.py; None: torch's own linear layers)."""
        self.model = model
        self.fixed_forward = fixed_forward
        self.linear = linear
        self.device = next(model.parameters()).device
        self.compact = compact
        self.cache = SlotCache(model.config)
        self._valid = torch.zeros(batch_size, GRANULE, dtype=torch.bool)  # on the host; room to spare
        self.num_slots = 0
        self._new = 0  # first slot of the last forward's queries
        self.forward_seconds = 0.0
        self._sync = device_sync(self.device)
        self.shared: PrefixRows | None = (
            None  # which shared prompt prefix each row reads (jfcore/decoding/runner/shared_prefix.py)
        )

    @property
    def valid(self) -> torch.Tensor:
        """[B, num_slots]: which slots hold each row's committed tokens."""
        return self._valid[:, : self.num_slots]

    @valid.setter
    def valid(self, value: torch.Tensor) -> None:
        rows, slots = value.shape
        if rows != self._valid.shape[0] or slots > self._valid.shape[1]:
            self._valid = torch.zeros(rows, _room(slots), dtype=torch.bool)
        self._valid[:, :slots] = value
        self._valid[:, slots:] = False
        self.num_slots = slots

    def lengths(self) -> torch.Tensor:
        """Committed tokens per row in its own slots (prompt included, a shared prefix not)."""
        return self.valid.sum(dim=1)

    def cached_tokens(self) -> list[int]:
        """Committed tokens with KV per row: its own slots and its shared prefix's: the next position id."""
        own = self.lengths().tolist()
        return own if self.shared is None else [n + p for n, p in zip(own, self.shared.lengths)]

    def forward(
        self,
        tokens: torch.Tensor,
        query_valid: torch.Tensor,
        positions: torch.Tensor,
        tree: torch.Tensor | None = None,
        packed: bool = False,
        **model_kwargs,
    ) -> torch.Tensor:
        """Run the model on `tokens` [B, Q] appended after the current slots.

        All inputs are host tensors, but `tree` may be on the device. `query_valid` marks real query
        tokens (others are row padding), `positions` are their position ids. `tree` [B, Q, Q], if
        given, says which new tokens each new token may attend to, row padding hidden (default: causal).
        Returns logits [B, Q, V], or with `packed` (and a model whose head can
        be split off: jfcore/decoding/runner/head.py) [N, V] for the N real queries
        in row-major order when there is row padding. The Q new slots stay in
        the cache until `keep` decides which of them are committed.
        """
        q = tokens.shape[1]
        fixed = self.fixed_forward is not None and self.num_slots > 0 and self.cache.in_place and self.shared is None
        if fixed:  # pad the queries to a bucket: padding slots are never kept, and `keep` crops them
            width = shape_bucket(q)
            tokens, query_valid, positions = (_pad(t, width) for t in (tokens, query_valid, positions))
            tree = None if tree is None else _pad(_pad(tree, width).transpose(1, 2), width).transpose(1, 2)
        self._new = self.num_slots
        self._append(query_valid)  # for the mask; `keep` then marks which of them are committed
        if tree is None and not fixed:
            mask = self.valid.long().to(self.device, non_blocking=True)
        else:
            mask = self._mask(query_valid, tree, view=granules(self.num_slots) if fixed else self.num_slots)
        inputs = {
            "input_ids": tokens.to(self.device, non_blocking=True),
            "attention_mask": mask,
            "position_ids": positions.to(self.device, non_blocking=True),
        }
        head = split_head(self.model) if packed and not fixed and not bool(query_valid.all()) else None
        start = time.perf_counter()
        if self.shared is not None:
            use_wrapper(self.model)  # the attention that reads the prefixes (the scheduler switches it back)
            model_kwargs["shared_prefix"] = self.shared
        if fixed:
            logits = self.fixed_forward(self.cache, inputs)[:, :q]
        else:
            with self.linear.over(tokens.numel()) if self.linear else contextlib.nullcontext():
                if head is not None:
                    logits = head(query_valid, **inputs, past_key_values=self.cache, use_cache=True, **model_kwargs)
                else:
                    logits = self.model(**inputs, past_key_values=self.cache, use_cache=True, **model_kwargs).logits
        self._sync()
        self.forward_seconds += time.perf_counter() - start
        self._valid[:, self._new : self.num_slots] = False
        return logits

    def _mask(self, query_valid: torch.Tensor, tree: torch.Tensor | None, view: int) -> torch.Tensor:
        """[B, 1, Q, view] additive mask: each query sees its row's valid slots, and the new ones its `tree` allows
        (default: the real queries, causally); slots past the cache's end are hidden. Only booleans go to the
        device ([B, old slots] and [B, Q, Q]); the mask, a float per query and slot (8 MB at 64 rows x 64 queries x
        512 slots), is built there rather than on the host and copied. Every query of a row sees the same old
        slots, so that part is one row of floats per batch row, broadcast by the one copy that writes the whole
        mask (docs/DESIGN.md, "The candidate tree is one comparison")."""
        rows, q = query_valid.shape
        if tree is None:
            causal = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
            tree = causal & query_valid.to(self.device, non_blocking=True)[:, None, :]
        old = self.valid[:, : self._new].to(self.device, non_blocking=True)
        new = tree.to(self.device)
        seen, hidden = self._mask_values
        parts = [torch.where(old, seen, hidden)[:, None, :].expand(-1, q, -1), torch.where(new, seen, hidden)]
        if view > self._new + q:
            parts.append(hidden.expand(rows, q, view - self._new - q))
        return torch.cat(parts, dim=2)[:, None]

    @functools.cached_property
    def _mask_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The additive mask's two values, 0 (seen) and the dtype's lowest (hidden), as 0-d tensors of the model's
        dtype on its device."""
        dtype = self.model.dtype
        return (
            torch.zeros((), dtype=dtype, device=self.device),
            torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.device),
        )

    def _append(self, slots: torch.Tensor) -> None:
        end = self.num_slots + slots.shape[1]
        if end > self._valid.shape[1]:
            grown = torch.zeros(self._valid.shape[0], _room(end), dtype=torch.bool)
            grown[:, : self.num_slots] = self.valid
            self._valid = grown
        self._valid[:, self.num_slots : end] = slots
        self.num_slots = end

    def keep(self, committed: torch.Tensor) -> None:
        """Mark which of the last forward's Q slots hold committed tokens [B, Q] (host)."""
        q = committed.shape[1]
        self._valid[:, self._new : self._new + q] = committed
        # Slots after every row's last valid one are dead for all rows: crop them.
        used = self.valid.any(dim=0).nonzero()
        self._crop(int(used[-1]) + 1 if len(used) else 0)

    def keep_first(self, counts: torch.Tensor, moved: torch.Tensor | None = None) -> None:
        """`keep` as each row's number of kept slots (host [B]), which are its first new ones once `moved` [M, 3]
        (row, from, to: slots counted from the last forward's first) is applied, without a [B, Q] tensor built row
        by row.

        A row that commits a candidate keeps its first slot and the candidate's, tens of slots further on: left
        there, they would hold every other row's new slots up to them as holes (a 64-row multiblock decode of 64
        tokens compacted its whole cache 11 times in 63 steps; now never). So in a cache written in place, kept
        slots are moved up to follow the row's first one (a few slots' keys and values; each keeps its position).
        Where the cache is not written in place (`mergeable` False) the kept slots stay where they are instead."""
        start = self._new
        if not self.cache.in_place:
            kept = [list(range(n)) for n in counts.tolist()]
            for b, source, target in moved.tolist() if moved is not None else []:
                kept[b][target] = source
            rows = host_tensor([b for b, slots in enumerate(kept) for _ in slots])
            self._valid[rows, host_tensor([s for slots in kept for s in slots]) + start] = True
            # Every row keeps at least its first slot, so the new slots after the last kept one are dead for all.
            self._crop(start + max((slots[-1] + 1 for slots in kept if slots), default=0))
            return
        if moved is not None:
            who, source, target = moved.to(self.device).unbind(1)
            self.cache.move_slots(who, source + start, target + start)
        new = self.num_slots - start
        self._valid[:, start : start + new] = torch.arange(new) < counts[:, None]
        self._crop(start + (int(counts.max()) if len(counts) else 0))

    def _crop(self, last: int) -> None:
        if last < self.num_slots:
            self.cache.crop(last - self.num_slots)
            self.num_slots = last
        self._maybe_compact()

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order (finished sequences leave the batch); in-place cache layers write only
        the rows whose place changes."""
        self.cache.keep_rows(rows, self.device)
        self.valid = self.valid[torch.tensor(rows)]
        self.shared = self.shared.select(rows) if self.shared is not None else None
        self._maybe_compact()

    def prefix_of_row(self, row: int, tokens: tuple[int, ...]) -> Prefix:
        """A shared prefix made of row `row`'s first committed slots, which hold `tokens` (the row reads no shared
        prefix itself): copied from its cache, not computed again."""
        slots = self.valid[row].nonzero()[: len(tokens), 0].to(self.device)
        layers = self.cache.layers
        return Prefix(
            tokens, [layer.keys[row][:, slots] for layer in layers], [layer.values[row][:, slots] for layer in layers]
        )

    @property
    def mergeable(self) -> bool:
        """Whether every cache layer is a plain in-place one, whose slots this class may move (see `extend`)."""
        return self.cache.in_place

    def extend(self, other: SlotBatch) -> None:
        """Append `other`'s rows (continuous batching) after this batch's, which stay where they are: the new
        rows' slots end where this batch's end, and when they are more, this batch's rows get holes after
        theirs. Holes are masked out like left padding (attention over a row's valid slots does not depend on
        where in the slot axis they lie: each token carries its own position)."""
        if not (self.mergeable and other.mergeable):
            raise ValueError("this model's cache has special layers (sliding window, ...): batches cannot merge")
        width = max(self.num_slots, other.num_slots)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.append_rows(theirs.keys, theirs.values)
        ours = torch.cat([self.valid, self.valid.new_zeros(self.valid.shape[0], width - self.num_slots)], dim=1)
        self.shared = PrefixRows.join(self.shared, len(ours), other.shared, len(other.valid))
        self.valid = torch.cat([ours, _left_grow(other.valid, width)], dim=0)

    def _maybe_compact(self) -> None:
        """Squeeze out holes once they waste a quarter of the cache (and at least 32 slots)."""
        counts = self.lengths()
        width = int(counts.max()) if len(counts) else 0
        waste = self.num_slots - width
        if not self.compact or waste < max(32, self.num_slots // 4):
            return
        # Sliding-window and other special layers keep their own bookkeeping: leave them alone.
        if not self.mergeable:
            return
        # Row b's valid slots, right-aligned into `width` slots (left padding for shorter rows).
        order = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, -width:]
        new_valid = torch.gather(self.valid, 1, order)
        self.cache.gather_slots(order.to(self.device))
        self.valid = new_valid


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` [B, Q, ...] with zeros (False) appended along dim 1 up to `width`."""
    if t.shape[1] == width:
        return t
    shape = list(t.shape)
    shape[1] = width - t.shape[1]
    return torch.cat([t, t.new_zeros(shape)], dim=1)


def _room(slots: int) -> int:
    """Host mask columns for `slots` slots: twice as many, in whole granules, so growing is rare."""
    return granules(2 * slots)


def _left_grow(slots: torch.Tensor, width: int) -> torch.Tensor:
    """`slots` with zero (invalid) slots added in front of the slot axis (dim 2 of KV, dim 1 of `valid`)."""
    dim = 1 if slots.dim() == 2 else 2
    missing = width - slots.shape[dim]
    if missing == 0:
        return slots
    shape = list(slots.shape)
    shape[dim] = missing
    return torch.cat([slots.new_zeros(shape), slots], dim=dim)


def left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host tensors for a batch of prompts of any lengths: left-padded token ids, a mask of the
    real tokens, and their position ids (each prompt counts from 0)."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p) :] = torch.tensor(list(p))
        valid[b, width - len(p) :] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return tokens, valid, positions


def host_tensor(values: Sequence) -> torch.Tensor:
    """A host int64 tensor from (nested, rectangular) lists of ints, through numpy: several times faster than
    `torch.tensor` on Python lists, which costs about a tenth of a microsecond per element."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def widen(t: torch.Tensor, cols: int) -> torch.Tensor:
    """`t` [B, C] with zero columns appended up to `cols` (itself if it has as many)."""
    if t.shape[1] >= cols:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], cols - t.shape[1])], dim=1)


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """What waits for queued GPU work (for honest timings); nothing on CPU."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
