"""Plain Jacobi rows as batch tensors: one step updates every row with a fixed number of tensor operations.

"Plain" is one block in flight without recycling: method "jacobi", and "ar" (a block of one), which may also
verify a prompt-lookup candidate after its known token (`lookup_tokens`; the candidate comes from
`BatchLookup`, jfcore/decoding/lookup.py). The acceptance rule is the one in jfcore/decoding/jacobi.py
(docs/DESIGN.md, section 1), written for the whole batch at once instead of row by row:

    accepted a   = 1 + the longest run where draft[j+1] == pred[j]  (AR + lookup: draft = known token + candidate)
    committed    = draft[:a], cut at the first EOS or the row's token budget
    next draft   = pred[a-1 :]  (the correction pred[a-1], then the model's fresh guesses), block size kept
    finished     = EOS or budget reached; else, if the block is used up, a fresh block opens at pred[a-1]

The only per-row Python left in a step is for rows that open a fresh block of two or more tokens (their seeded
filler is drawn from their own `random.Random`, as in the row-by-row decoder, so drafts and trajectories are the
same) and rows that finish (their tokens are copied out once). With `sync_rows` (serving, recording) every row's
`Row.out` is also kept current each step.
"""

from __future__ import annotations

import torch

from jfcore.decoding.lookup import BatchLookup
from jfcore.decoding.result import StepEvent
from jfcore.decoding.slots import SlotBatch, host_tensor, widen


class PlainRows:
    """The dynamic state of a batch's rows; position b of every tensor is `rows[b]` and row b of the cache."""

    def __init__(self, decoder, sync_rows: bool = False):
        self.d = decoder
        self.sync_rows = sync_rows or decoder.record
        n = decoder.block_size
        self.rows = []
        self.draft = torch.zeros(0, n, dtype=torch.long)  # block 0's tokens; draft[b, 0] is the known next token
        self.dlen = torch.zeros(0, dtype=torch.long)  # draft tokens still unverified (block size - done)
        self.base = torch.zeros(0, dtype=torch.long)  # committed tokens, prompt included: the next position
        self.out = torch.zeros(0, 0, dtype=torch.long)  # new tokens per row
        self.nout = torch.zeros(0, dtype=torch.long)
        self.limit = torch.zeros(0, dtype=torch.long)  # token budget per row
        self.joined = torch.zeros(0, dtype=torch.long)  # step at which the row joined (its forwards are the rest)
        self.recycled = torch.zeros(0, dtype=torch.long)  # candidate tokens committed
        self.eos = torch.tensor(sorted(decoder.eos), dtype=torch.long)
        cfg = decoder.config
        self.lookup = BatchLookup(cfg.lookup_ngram, cfg.lookup_tokens) if cfg.lookup_tokens else None
        self.steps = 0

    def add(self, rows) -> None:
        """Rows fresh from prefill, each with one open block and no tokens out yet."""
        n = self.d.block_size
        cap = max([self.out.shape[1], *(r.max_new_tokens + n for r in rows)])
        self.out = widen(self.out, cap)
        self.draft = torch.cat(
            [self.draft, torch.tensor([r.blocks[0] + [self.d.pad] * (n - len(r.blocks[0])) for r in rows])]
        )
        self.dlen = torch.cat([self.dlen, torch.tensor([len(r.blocks[0]) for r in rows])])
        self.base = torch.cat([self.base, torch.tensor([len(r.prompt) for r in rows])])
        self.out = torch.cat([self.out, torch.zeros(len(rows), cap, dtype=torch.long)])
        self.nout = torch.cat([self.nout, torch.zeros(len(rows), dtype=torch.long)])
        self.limit = torch.cat([self.limit, torch.tensor([r.max_new_tokens for r in rows])])
        self.joined = torch.cat([self.joined, torch.full((len(rows),), self.steps)])
        self.recycled = torch.cat([self.recycled, torch.zeros(len(rows), dtype=torch.long)])
        if self.lookup is not None:
            self.lookup.add([r.prompt for r in rows], [r.max_new_tokens + n for r in rows])
        self.rows += rows

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long)
        for name in ("draft", "dlen", "base", "out", "nout", "limit", "joined", "recycled"):
            setattr(self, name, getattr(self, name)[index])
        if self.lookup is not None:
            self.lookup.select(index)
        self.rows = [self.rows[i] for i in keep]

    def step(self, batch: SlotBatch) -> None:
        """One forward for every row; finished rows get their tokens and `finished` set (they stay until removed)."""
        d, rows = self.d, self.rows
        draft, dlen = self.draft, self.dlen
        if self.lookup is not None:  # AR: the known token, then the copied candidate
            copied, proposed = self.lookup.propose(draft[:, 0], self.limit - self.nout - 1)
            draft, dlen = torch.cat([draft, copied], dim=1), dlen + proposed
        width = int(dlen.max())
        j = torch.arange(width)
        drafted = j < dlen[:, None]
        tokens = draft[:, :width].masked_fill(~drafted, d.pad)
        if d.record:
            self._record_states(tokens)
        logits = batch.forward(tokens, drafted, self.base[:, None] + j, packed=True)
        pred = d.choose(logits, rows, lambda: self.nout[:, None] + 1 + j, drafted)  # the step's one host sync

        a = 1 + ((tokens[:, 1:] == pred[:, :-1]) & drafted[:, 1:]).long().cumprod(1).sum(1)
        budget = self.limit - self.nout
        room = torch.minimum(a, budget)
        eos_at = torch.isin(tokens, self.eos) & (j < room[:, None])
        has_eos = eos_at.any(1)
        take = torch.where(has_eos, eos_at.long().argmax(1) + 1, room)
        done = has_eos | (a >= budget)  # stops within the committed run
        self._emit(tokens, take)
        correction = pred.gather(1, (a - 1)[:, None]).squeeze(1)
        # Not stopped yet: the correction is the known next token; it ends the row if it is EOS or the last one.
        last = ~done & (torch.isin(correction, self.eos) | (self.nout + 1 >= self.limit))
        self._emit(correction[:, None], last.long())
        finished = done | last
        batch.keep(j < a[:, None])

        self.base += a
        if self.lookup is not None:
            self.lookup.update(proposed, a - 1)
            self.lookup.extend(tokens, a)
            self.recycled += a - 1
        left = (self.dlen - a).clamp(min=0)  # AR + lookup: a block of one, used up whatever was accepted
        # Jacobi update: position k of the remaining draft is the model's prediction after slot a-1+k.
        kept = min(width, self.draft.shape[1])
        self.draft[:, :kept] = pred.gather(1, ((a - 1)[:, None] + j[:kept]).clamp(max=width - 1))
        self.dlen = left
        opening = ~finished & (left == 0)
        self.steps += 1

        finished_rows = finished.nonzero().flatten().tolist()
        opening_rows = opening.nonzero().flatten().tolist()
        if self.sync_rows or finished_rows or (opening_rows and d.block_size > 1):
            self._to_rows(tokens, take, correction, last, finished_rows, opening_rows)
        self._open(opening_rows)
        if d.on_step is not None:
            d.on_step(
                StepEvent(
                    self.steps - 1,
                    [r.index for r in rows],
                    a.tolist(),
                    self.base.tolist(),
                    batch.cached_tokens(),
                    drafted.sum(1).tolist(),
                )
            )

    def _emit(self, tokens: torch.Tensor, take: torch.Tensor) -> None:
        """Append `tokens[b, :take[b]]` to each row's output."""
        k = torch.arange(tokens.shape[1])
        mask = k < take[:, None]
        rows, cols = mask.nonzero(as_tuple=True)
        self.out[rows, self.nout[rows] + cols] = tokens[rows, cols]
        self.nout += take

    def _to_rows(self, tokens, take, correction, last, finished_rows, opening_rows) -> None:
        """Bring the Python side of rows up to date: all of them (`sync_rows`), else those that finish or open."""
        d = self.d
        sync = range(len(self.rows)) if self.sync_rows else sorted({*finished_rows, *opening_rows})
        # Whole columns read once: a few tensor reads, not a few per row.
        forwards = (self.steps - self.joined).tolist()
        recycled, base = self.recycled.tolist(), self.base.tolist()
        finished = set(finished_rows)
        if self.sync_rows:
            taken = take.tolist()
            toks = tokens.tolist()
            ends = last.tolist()
            corr = correction.tolist()
        else:
            nout = self.nout.tolist()
            outs = dict(zip(sync, self.out[list(sync)].tolist()))
        for b in sync:
            row = self.rows[b]
            row.forwards = forwards[b]
            row.recycled = recycled[b]
            if self.sync_rows:
                row.out.extend(toks[b][: taken[b]])
                if ends[b]:
                    row.out.append(corr[b])
            else:
                row.out = outs[b][: nout[b]]
            row.verified = base[b] - len(row.prompt)
            if b in finished:
                row.finished = True
            if d.record:
                self._close_block(row, b, finished=b in finished)

    def _record_states(self, tokens: torch.Tensor) -> None:
        lengths = self.dlen.tolist()
        for row, draft, n in zip(self.rows, tokens.tolist(), lengths):
            row.states.append(row.out[row.block_start :] + draft[:n])

    def _close_block(self, row, b: int, finished: bool) -> None:
        """A row whose block ended this step (used up, or the row finished): record its trajectory."""
        if finished:
            if int(self.dlen[b]) == 0 and len(row.out) > row.block_start + row.sizes[0]:
                # The block was used up and then the correction finished the row: that token is a block of its own.
                self.d._close_block(row, row.block_start + row.sizes[0])
                row.block_start += row.sizes[0]
            self.d._close_block(row, len(row.out))
        elif int(self.dlen[b]) == 0:
            self.d._close_block(row, row.block_start + row.sizes[0])

    def _open(self, opening_rows: list[int]) -> None:
        """Fresh blocks for rows that used theirs up: the correction (already at draft[b, 0]), then seeded filler."""
        if not opening_rows:
            return
        d = self.d
        n = d.block_size
        sizes = torch.minimum(self.limit[opening_rows] - self.nout[opening_rows], torch.tensor(n))
        self.dlen[opening_rows] = sizes
        if n == 1 and not d.record:  # AR: the block is the correction alone, nothing to draw or record
            return
        fill_rows: list[int] = []
        fill_cols: list[int] = []
        filled: list[int] = []
        for b, size in zip(opening_rows, sizes.tolist()):
            row = self.rows[b]
            row.block_start = len(row.out)
            row.sizes = [size]
            filled += d.filler(row, size - 1)
            fill_rows += [b] * (size - 1)
            fill_cols += range(1, size)
        if filled:  # one write for every opening row's filler
            self.draft[host_tensor(fill_rows), host_tensor(fill_cols)] = host_tensor(filled)
