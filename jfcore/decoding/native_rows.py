"""The row-by-row step with its rules in C (jfcore/decoding/_rows.c; docs/DESIGN.md, "Rows in C").

`JacobiDecoder._step` in jfcore/decoding/jacobi.py is the reference: the same layout of every row's draft and
pool candidates, one forward, the greedy choice at every query, and the same acceptance and draft update, which
leave every `Row` as the Python rules would (its pool and prompt lookup are the C ones, `ngram_pool.RowPool` and
`lookup.RowLookup`; a closed block's trajectory is recorded by the decoder's `_close_block`). It runs for every
step where the C module was built; otherwise the Python rules or batch tensors do. The choice is made in C
where every row is greedy and the logits are few and float32 on the CPU, otherwise by `sampling.choose` as in
Python. The step's arrays are bytearrays filled in C, which torch reads in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from jfcore.decoding.result import StepEvent
from jfcore.decoding.sampling import TWO_PASS_LOGITS
from jfcore.decoding.slots import SlotBatch

try:  # built at install where a C compiler is at hand (pyproject.toml)
    from jfcore.decoding import _native
except ImportError:
    _native = None

if TYPE_CHECKING:
    from jfcore.decoding.jacobi import JacobiDecoder
    from jfcore.decoding.rows import Row


TreeMask = Callable[[torch.Tensor, torch.device], torch.Tensor]  # jacobi.py's `_tree`: offsets -> [B, Q, Q] mask
# Greedy choices over at most this many float32 logits are made in C (one thread, no tensor operations); over more,
# torch's two-pass choice (`sampling.greedy_argmax`, from the same size on), on every intra-op thread, is faster
# (docs/DESIGN.md, "Rows in C").
C_CHOICE_LOGITS = TWO_PASS_LOGITS


def native_step(decoder: JacobiDecoder, tree_mask: TreeMask) -> NativeStep | None:
    """The C step for this decoder's rows, or None where the C module was not built."""
    return NativeStep(decoder, tree_mask) if _native is not None else None


class NativeStep:
    def __init__(self, decoder: JacobiDecoder, tree_mask: TreeMask):
        self.d = decoder
        self.tree_mask = tree_mask
        cfg = decoder.config
        copied_beside = cfg.lookup_tokens > 0 and not cfg.lookup_within  # the copy is a candidate of its own
        self.max_candidates = (cfg.pool_size if cfg.recycling else 0) + int(copied_beside)
        self.lookup_within = cfg.lookup_within
        self.rules = (
            tuple(decoder.eos),
            decoder.block_size,
            cfg.blocks_in_flight,
            cfg.spawn_ratio,
            decoder.record,
            decoder,
        )

    def __call__(self, batch: SlotBatch, rows: list[Row], step: int) -> None:
        d = self.d
        tokens, positions, offsets, valid, meta, width, tree = _native.layout(
            rows, d.pad, self.max_candidates, self.lookup_within, d.record
        )
        shape = (len(rows), width)
        query_valid = torch.frombuffer(valid, dtype=torch.bool).view(shape)
        mask = self.tree_mask(torch.frombuffer(offsets, dtype=torch.long).view(shape), batch.device) if tree else None
        logits = batch.forward(
            torch.frombuffer(tokens, dtype=torch.long).view(shape),
            query_valid,
            torch.frombuffer(positions, dtype=torch.long).view(shape),
            mask,
            packed=True,
        )
        cpu_float32 = logits.device.type == "cpu" and logits.dtype == torch.float32
        if cpu_float32 and logits.numel() <= C_CHOICE_LOGITS and all(r.sampling.greedy for r in rows):
            packed = logits.dim() == 2
            choices = _native.greedy(logits.contiguous().numpy(), valid if packed else None, *shape, logits.shape[-1])
        else:  # many logits, sampled rows, a GPU (the step's one host sync) or another dtype: as in Python

            def generated() -> torch.Tensor:
                ahead = torch.tensor([len(r.out) + 1 for r in rows])[:, None]
                return torch.frombuffer(offsets, dtype=torch.long).view(shape) + ahead

            choices = d.choose(logits, rows, generated, query_valid).numpy()
        kept, moved = _native.verify(rows, tokens, choices, meta, width, *self.rules)
        counts = torch.frombuffer(kept, dtype=torch.long)
        moves = torch.frombuffer(moved, dtype=torch.long).view(-1, 3) if moved else None
        batch.keep_first(counts, moves)
        if d.on_step is not None:
            committed = [len(r.prompt) + r.verified for r in rows]
            lengths = query_valid.sum(1).tolist()
            d.on_step(
                StepEvent(step, [r.index for r in rows], counts.tolist(), committed, batch.cached_tokens(), lengths)
            )
