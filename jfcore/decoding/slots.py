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

Only the public transformers API is used: a `DynamicCache`, its `crop` and
`batch_select_indices`, a 2D attention mask (or a 4D additive mask for tree
verification) and explicit `position_ids`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SlotBatch:
    def __init__(self, model: torch.nn.Module, batch_size: int, compact: bool = True):
        self.model = model
        self.device = next(model.parameters()).device
        self.compact = compact
        self.cache = DynamicCache(config=model.config)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool)  # on the host
        self.forward_seconds = 0.0
        self._sync = device_sync(self.device)

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def lengths(self) -> torch.Tensor:
        """Committed tokens per row (prompt included): the next position id."""
        return self.valid.sum(dim=1)

    def forward(
        self,
        tokens: torch.Tensor,
        query_valid: torch.Tensor,
        positions: torch.Tensor,
        tree: torch.Tensor | None = None,
        **model_kwargs,
    ) -> torch.Tensor:
        """Run the model on `tokens` [B, Q] appended after the current slots.

        All inputs are host tensors. `query_valid` marks real query tokens
        (others are row padding), `positions` are their position ids. `tree`
        [B, Q, Q], if given, says which new tokens each new token may attend
        to (default: causal).
        Returns logits [B, Q, V]; the Q new slots stay in the cache until
        `keep` decides which of them are committed.
        """
        if tree is None:
            mask = torch.cat([self.valid, query_valid], dim=1).long().to(self.device, non_blocking=True)
        else:
            seen = tree & query_valid[:, None, :]
            seen = torch.cat([self.valid[:, None, :].expand(-1, tokens.shape[1], -1), seen], dim=2)
            seen = seen.to(self.device, non_blocking=True)
            dtype = self.model.dtype
            mask = torch.zeros(seen.shape, dtype=dtype, device=self.device)
            mask.masked_fill_(~seen, torch.finfo(dtype).min)
            mask = mask[:, None]
        start = time.perf_counter()
        out = self.model(
            input_ids=tokens.to(self.device, non_blocking=True),
            attention_mask=mask,
            position_ids=positions.to(self.device, non_blocking=True),
            past_key_values=self.cache,
            use_cache=True,
            **model_kwargs,
        )
        self._sync()
        self.forward_seconds += time.perf_counter() - start
        self.valid = torch.cat([self.valid, torch.zeros_like(query_valid)], dim=1)
        return out.logits

    def keep(self, committed: torch.Tensor) -> None:
        """Mark which of the last forward's Q slots hold committed tokens [B, Q] (host)."""
        q = committed.shape[1]
        self.valid[:, -q:] = committed
        # Slots after every row's last valid one are dead for all rows: crop them.
        used = self.valid.any(dim=0).nonzero()
        last = int(used[-1]) + 1 if len(used) else 0
        if last < self.num_slots:
            self.cache.crop(last - self.num_slots)
            self.valid = self.valid[:, :last]
        self._maybe_compact()

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (finished sequences leave the batch)."""
        index = torch.tensor(rows)
        self.cache.batch_select_indices(index.to(self.device))
        self.valid = self.valid[index]
        self._maybe_compact()

    @property
    def mergeable(self) -> bool:
        """Whether every cache layer is a plain dynamic one, whose slots this class may move (see `extend`)."""
        layers = getattr(self.cache, "layers", [])
        return all(type(layer) is DynamicLayer and layer.keys is not None for layer in layers)

    def extend(self, other: SlotBatch) -> None:
        """Append `other`'s rows (continuous batching). Both are right-aligned to the wider slot count; the
        shorter side's new leading slots are holes, masked out like left padding."""
        if not (self.mergeable and other.mergeable):
            raise ValueError("this model's cache has special layers (sliding window, ...): batches cannot merge")
        width = max(self.num_slots, other.num_slots)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_grow(mine.keys, width), _left_grow(theirs.keys, width)], dim=0)
            mine.values = torch.cat([_left_grow(mine.values, width), _left_grow(theirs.values, width)], dim=0)
        self.valid = torch.cat([_left_grow(self.valid, width), _left_grow(other.valid, width)], dim=0)

    def _maybe_compact(self) -> None:
        """Squeeze out holes once they waste a quarter of the cache (and at least 32 slots)."""
        counts = self.lengths()
        width = int(counts.max()) if len(counts) else 0
        waste = self.num_slots - width
        if not self.compact or waste < max(32, self.num_slots // 4):
            return
        # Sliding-window and other special layers keep their own bookkeeping: leave them alone.
        if not getattr(self.cache, "layers", None) or not self.mergeable:
            return
        # Row b's valid slots, right-aligned into `width` slots (left padding for shorter rows).
        order = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, -width:]
        new_valid = torch.gather(self.valid, 1, order)
        order = order.to(self.device)
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = torch.gather(layer.keys, 2, index)
            layer.values = torch.gather(layer.values, 2, index)
        self.valid = new_valid


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


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """What waits for queued GPU work (for honest timings); nothing on CPU."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
