"""One decode forward's input, as both rules backends lay it out, and the tree mask it may need
(docs/DESIGN.md, section 7).

Each row puts its draft in the forward, then its candidates (recycled n-grams, the prompt-lookup copy), each
candidate at offsets 1, 2, ... past the draft's first token again: a candidate sees that first token and its own
prefix, nothing of the draft.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class StepInput:
    """[B, Q] host tensors of one forward: query tokens, which are real (the rest is row padding), their positions,
    and their offsets past each row's draft[0] (None where no row needs the tree mask and the backend skipped
    them). `tree`: some row needs the tree mask. `state`: what the backend that laid it out reads back in its
    `commit`."""

    tokens: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    offsets: torch.Tensor | None
    tree: bool
    state: object = None

    def mask(self, device: torch.device) -> torch.Tensor | None:
        return tree_mask(self.offsets, device) if self.tree else None


@dataclass
class Kept:
    """What a step keeps of each row's new cache slots: its first `counts[b]` ones (host [B]; the tokens it
    committed), once `moves` (host [M, 3]: row, from, to) has moved a committed candidate's slots up to follow the
    row's first slot."""

    counts: torch.Tensor
    moves: torch.Tensor | None


def tree_mask(offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[B, Q, Q] on `device`: causal among each row's draft; each candidate sees the draft's first token and its
    own prefix. `offsets` [B, Q]: each query's position past the draft's first token (the draft 0, 1, 2, ...; each
    candidate 1, 2, ... again; row padding 0).

    So query i at offset k sees column 0 (the draft's first token), itself and the k - 1 queries before it: for
    the draft the whole draft up to itself, for a candidate its own prefix; padding sees column 0. That is one
    comparison with a fixed matrix per width (`_lags`) for the whole batch, where the mask is built (only the
    offsets cross to a GPU)."""
    return _lags(offsets.shape[1], device) < offsets.to(device, non_blocking=True)[:, :, None]


@functools.cache
def _lags(width: int, device: torch.device) -> torch.Tensor:
    """[width, width]: i - j for 1 <= j <= i, -1 at j = 0 (seen at any offset), `width` above the diagonal (never
    seen): query i at offset k sees key j exactly where this is < k."""
    rows, columns = torch.arange(width, device=device)[:, None], torch.arange(width, device=device)
    lags = (rows - columns).masked_fill_(columns > rows, width)
    lags[:, 0] = -1
    return lags
