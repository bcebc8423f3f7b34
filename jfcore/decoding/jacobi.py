"""Greedy Jacobi decoding on a KV cache (docs/DESIGN.md, sections 1 and 7).

A row's in-flight draft is a list of blocks laid end to end on top of its
committed text. Block 0 (real-active) starts with the known next greedy
token; later blocks (pseudo-active, multiblock only) iterate on top of block
0's unverified draft. One forward over the whole draft gives the greedy
prediction at every position. The accepted tokens are 1 + the longest run
where draft[i+1] == argmax(logits[i]): they and their KV are exact, so they
are committed, and the KV of the rest is dropped. The remaining positions get
the Jacobi update: the correction token, then the model's fresh predictions.
Acceptance may run past a block boundary: the next block is then promoted
with its verified progress kept.

Rejection recycling (multiblock): n-grams from rejected draft tails are kept
in a pool; continuations of the draft's first token are verified in the same
forward as extra positions that see only the committed text and that first
token (a tree mask). The longest verified run wins. Prompt lookup (any method,
`lookup_tokens` > 0) adds one more such candidate: the text that followed the
latest earlier occurrence of the row's last tokens (jfcore/decoding/lookup.py).

Every committed token is checked against the model's own argmax, so the
output equals greedy autoregressive decoding exactly, whatever the drafts.
AR decoding is the special case of one block of size 1. A sampled row reads
"the row's keyed sample" for "argmax" (jfcore/decoding/sampling.py): again a
function of the prefix, so the output equals sequential sampling exactly.

The rules are written here row by row. Where the C module was built, every
step runs the same rules in C (jfcore/decoding/native_rows.py); otherwise rows
with one block and no candidates (ar, jacobi) run them as batch tensors
(jfcore/decoding/batch_rows.py).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import random
import time
from collections.abc import Callable, Collection

import torch

from jfcore.decoding.compiled import fixed_forward
from jfcore.decoding.config import DecodeConfig
from jfcore.decoding.linear import FasterLinear, faster_linear
from jfcore.decoding.lookup import RowLookup
from jfcore.decoding.native_rows import native_step
from jfcore.decoding.ngram_pool import RowPool
from jfcore.decoding.result import BlockTrajectory, DecodeOutput, DecodeStats, StepEvent
from jfcore.decoding.rows import Candidates, Row, refill
from jfcore.decoding.sampling import Sampling, choose
from jfcore.decoding.scheduler import LiveBatch
from jfcore.decoding.shared_prefix import restore
from jfcore.decoding.slots import SlotBatch, host_tensor

BATCH_TENSOR_ROWS = 8
LOOKUP_BATCH_TENSOR_ROWS = 64


class JacobiDecoder:
    def __init__(
        self,
        model: torch.nn.Module,
        config: DecodeConfig,
        eos_token_ids: Collection[int],
        pad_token_id: int,
        on_step: Callable[[StepEvent], None] | None = None,
    ):
        self.model = model
        self.config = config
        self.block_size = 1 if config.method == "ar" else config.block_size
        self.record = config.record_trajectories
        self.eos = frozenset(eos_token_ids)
        self.pad = pad_token_id
        self.on_step = on_step
        self.fixed_forward = fixed_forward(model, config.compile)
        # Prompt prefixes shared between rows are read by an eager attention: fixed-shape forwards keep their own.
        self.share_prefix_tokens = config.share_prefix_tokens if self.fixed_forward is None else 0
        # Steps with their rules in C (jfcore/decoding/native_rows.py), where the C module was built.
        self.native_step = native_step(self, _tree)
        # Otherwise one block and no candidates, or AR with a prompt-lookup candidate: from this many rows on, a
        # decode runs them as batch tensors (jfcore/decoding/batch_rows.py), whose step costs a fixed ~0.3 ms of
        # tensor ops on a CPU host (~0.7 ms with the lookup's); below it, the row-by-row rules cost less
        # (bench/step_overhead.py: about even at 8 rows, with lookup at 64). The C step costs less than either at
        # 8 to 128 rows (docs/DESIGN.md, "Rows in C"). None: never.
        one_block = config.blocks_in_flight == 1 and not config.recycling
        plain = one_block and (not config.lookup_tokens or self.block_size == 1) and self.native_step is None
        rows_from = LOOKUP_BATCH_TENSOR_ROWS if config.lookup_tokens else BATCH_TENSOR_ROWS
        self.batch_tensors_from: int | None = rows_from if plain else None
        # Prefill needs only the last position's logits: skip the vocabulary projection elsewhere.
        takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.prefill_kwargs = {"logits_to_keep": 1} if takes_keep else {}

    @functools.cached_property
    def linear(self) -> FasterLinear | None:
        """Eager forwards' linear layers: torch's kernels, or where measured faster the weight-first product.
        Resolved at the first forward, so that the probe runs on the thread that decodes (jf-serve's engine thread,
        not the one that built the decoder: docs/DESIGN.md, "Linear layers on a CPU")."""
        return faster_linear(self.model, self.config.linear) if self.fixed_forward is None else None

    def new_row(
        self,
        index: int,
        prompt: list[int],
        max_new_tokens: int | None = None,
        sampling: tuple[Sampling, int] | None = None,
    ) -> Row:
        """A row for `prompt`. Its filler generator is seeded by the seed and the prompt, so a prompt's drafts
        (and its recorded trajectory) do not depend on which prompts share its batch. `sampling`: its own settings
        and sample index (default: the config's settings, sample index `index`)."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        limit = max_new_tokens or self.config.max_new_tokens
        settings, sample = sampling or (self.config.sampling, index)
        if self.record and not settings.greedy:
            raise ValueError("recorded trajectories are greedy fixed points: a sampled row cannot be recorded")
        row = Row(
            index,
            list(prompt),
            max_new_tokens=limit,
            rng=random.Random(f"{self.config.seed}:{list(prompt)}"),
            sampling=settings,
            sample=sample,
        )
        if self.config.recycling:
            row.pool = RowPool(self.config.pool_size, self.config.ngram_size)
        if self.config.lookup_tokens:
            row.lookup = RowLookup(self.config.lookup_ngram, self.config.lookup_tokens, row.prompt)
        return row

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]]) -> DecodeOutput:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("decode needs at least one prompt, and every prompt at least one token")
        stats = DecodeStats()
        start_from = self.batch_tensors_from
        live = LiveBatch(self, batch_tensors=start_from is not None and len(prompts) >= start_from)
        try:
            start = time.perf_counter()
            rows = live.add(prompts)
            stats.prefill_seconds = time.perf_counter() - start
            start = time.perf_counter()
            with collector_paused():
                while live.rows:
                    live.step()
            stats.decode_seconds = time.perf_counter() - start
        finally:
            restore(self.model)  # its own attention, whatever happened (see jfcore/decoding/shared_prefix.py)
        stats.forward_calls = live.steps
        stats.forward_seconds = live.forward_seconds
        stats.tokens_per_row = [len(r.out) for r in rows]
        stats.forwards_per_row = [r.forwards for r in rows]
        stats.new_tokens = sum(stats.tokens_per_row)
        stats.decode_forwards = sum(stats.forwards_per_row)
        stats.recycled_tokens = sum(r.recycled for r in rows)
        trajectories = [r.trajectories for r in rows] if self.record else None
        return DecodeOutput([r.out for r in rows], stats, trajectories)

    # -- one decode forward for every active row ---------------------------------------------

    def _step(self, batch: SlotBatch, rows: list[Row], step: int) -> None:
        if self.native_step is not None:
            return self.native_step(batch, rows, step)
        # The inputs are built as Python lists and become tensors in one call each (through numpy: `host_tensor`):
        # per-row tensor writes, or torch.tensor on lists, would cost more than the rest of the step's host work.
        layouts = [self._layout(row) for row in rows]
        lengths = [len(inputs) for inputs, _, _ in layouts]
        width = max(lengths)
        pad = self.pad
        tokens = host_tensor([inputs + [pad] * (width - n) for (inputs, _, _), n in zip(layouts, lengths)])
        # Offsets from draft[0]'s position (row padding: 0), then every row's own in one tensor addition.
        offsets = host_tensor([o + [0] * (width - n) for (_, o, _), n in zip(layouts, lengths)])
        committed = host_tensor([len(row.prompt) + row.verified for row in rows])  # draft[0]'s position, no sync
        positions = offsets + committed[:, None]
        valid = torch.arange(width) < host_tensor(lengths)[:, None]

        def generated() -> torch.Tensor:
            """What each query predicts: the token after it, whose generated position counts from draft[0]'s."""
            return offsets + host_tensor([len(row.out) + 1 for row in rows])[:, None]

        # A row whose draft is one token and that has one candidate is a plain causal chain.
        use_tree = any(cands and (len(inputs) - len(cands[0][1]) > 1 or len(cands) > 1) for inputs, _, cands in layouts)
        tree = _tree(offsets, batch.device) if use_tree else None
        logits = batch.forward(tokens, valid, positions, tree, packed=True)
        predictions = self.choose(logits, rows, generated, valid).tolist()  # one host sync per forward
        keep, accepted = [], []
        for row, pred, (inputs, _, cands) in zip(rows, predictions, layouts):
            slots = self._verify(row, pred, cands, inputs[: cands[0][0]] if cands else inputs)
            keep.append(slots)
            accepted.append(len(slots))
        batch.keep_slots(keep)
        if self.on_step is not None:
            committed = [len(r.prompt) + r.verified for r in rows]
            self.on_step(StepEvent(step, [r.index for r in rows], accepted, committed, batch.cached_tokens(), lengths))

    def choose(
        self,
        logits: torch.Tensor,
        rows: list[Row],
        generated: Callable[[], torch.Tensor],
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, Q] host tensor of each row's choice at each query (greedy, or sampled: jfcore/decoding/sampling.py);
        `generated()` [B, Q]: the generated position of the token each query predicts (built only for sampling);
        `valid`: the real queries, when `logits` holds only theirs."""
        return choose(logits, [r.sampling for r in rows], [r.sample for r in rows], generated, valid)

    def _layout(self, row: Row) -> tuple[list[int], list[int], Candidates]:
        """The row's forward input: its draft, then recycled and prompt-lookup candidates; and their position
        offsets. The prompt-lookup candidate, if any, is the last one."""
        if row.lookup is not None and self.config.lookup_within:
            self._copy_into_draft(row)
        draft = row.draft
        if self.record:
            row.states.append(row.out[row.block_start :] + draft)
        grams = row.pool.candidates(draft[0], len(draft) - 1) if row.pool is not None and len(draft) > 1 else []
        if row.lookup is not None and not self.config.lookup_within:
            row.copied = copied = tuple(row.lookup.propose(draft[0], row.max_new_tokens - len(row.out) - 1))
            if copied and copied not in grams:
                grams.append(copied)
        inputs, offsets, cands = draft, list(range(len(draft))), []  # `row.draft` is a fresh list: extended in place
        for gram in grams:
            cands.append((len(inputs), gram))
            inputs.extend(gram)
            offsets.extend(range(1, len(gram) + 1))
        return inputs, offsets, cands

    def _copy_into_draft(self, row: Row) -> None:
        """`lookup_within`: the copied text takes the place of the draft's unverified guesses, so the forward keeps
        its width (any draft is verified the same way)."""
        draft = row.draft
        row.copied = copied = tuple(row.lookup.propose(draft[0], len(draft) - 1))
        if not copied:
            return
        draft[1 : 1 + len(copied)] = copied
        refill(row, draft)

    def _verify(self, row: Row, pred: list[int], cands: Candidates, draft: list[int]) -> list[int]:
        """Commit the longest verified run of `draft` (the row's, as the forward saw it) or a candidate, and update
        the rest of the draft. Returns the kept slots."""
        a = 1
        while a < len(draft) and draft[a] == pred[a - 1]:
            a += 1
        slots, accepted = list(range(a)), draft[:a]
        for start, gram in cands:
            k, parent = 0, 0
            while k < len(gram) and gram[k] == pred[parent]:
                parent = start + k
                k += 1
            if 1 + k > len(slots):
                slots, accepted = [0, *range(start, start + k)], [draft[0], *gram[:k]]
        correction = pred[slots[-1]]
        if row.lookup is not None:
            # The copied text's own verified run: it cannot outrun the committed one (it would have won).
            held = next((i for i, (c, t) in enumerate(zip(row.copied, accepted[1:])) if c != t), None)
            row.lookup.update(len(row.copied), min(len(row.copied), len(accepted) - 1) if held is None else held)
        row.recycled += max(0, len(accepted) - a)
        row.forwards += 1
        row.verified += len(accepted)
        if row.pool is not None:
            row.pool.add(draft[a:])  # the rejected tail: right phrases at wrong offsets come back
        progress = self._newest_progress(row, draft, pred) if self.config.blocks_in_flight > 1 else 0
        guess = pred[len(draft) - 1]  # the model's token after the whole draft
        rest = [correction, *pred[len(accepted) : len(draft) - 1]]  # the Jacobi update
        if self._emit(row, accepted):
            return slots
        if row.lookup is not None:
            row.lookup.extend(accepted)
        self._consume(row, len(accepted))
        refill(row, rest)
        self._carry_on(row, correction, guess, progress)
        return slots

    def _newest_progress(self, row: Row, draft: list[int], pred: list[int]) -> int:
        """Leading tokens of the newest block that are committed or left unchanged by this update."""
        start = len(draft) - len(row.blocks[-1])
        i = max(start, 1)
        while i < len(draft) and draft[i] == pred[i - 1]:
            i += 1
        return (row.done if len(row.blocks) == 1 else 0) + i - start

    def _consume(self, row: Row, count: int) -> None:
        """Remove `count` committed tokens from the front of the in-flight blocks (a prompt-lookup candidate may
        commit more than they hold)."""
        while count > 0 and row.blocks:
            take = min(count, len(row.blocks[0]))
            count -= take
            if take < len(row.blocks[0]):
                row.blocks[0] = row.blocks[0][take:]
                row.done += take
                continue
            size = row.sizes.pop(0)
            row.blocks.pop(0)
            self._close_block(row, row.block_start + size)
            row.block_start += size
            row.done = 0

    # -- emitting tokens, finishing, starting blocks ----------------------------------------

    def _emit(self, row: Row, accepted: list[int]) -> bool:
        """Append committed tokens, stopping at the first EOS or the token budget. True if finished."""
        budget = row.max_new_tokens - len(row.out)
        if len(accepted) < budget and self.eos.isdisjoint(accepted):  # the common case, without a Python loop
            row.out.extend(accepted)
            return False
        cut = next((i + 1 for i, t in enumerate(accepted[:budget]) if t in self.eos), None)
        self._finish(row, accepted[: cut or budget])
        return True

    def _carry_on(self, row: Row, next_token: int, guess: int, progress: int) -> None:
        """Finish with the known next token, or keep drafting from it."""
        cfg = self.config
        if next_token in self.eos or len(row.out) + 1 >= row.max_new_tokens:
            if not row.blocks:
                row.block_start = len(row.out)
            self._finish(row, [next_token])
        elif not row.blocks:
            row.block_start = len(row.out)
            self._open_block(row, next_token)
        elif len(row.blocks) < cfg.blocks_in_flight and progress >= cfg.spawn_ratio * row.sizes[-1]:
            self._open_block(row, guess)

    def _open_block(self, row: Row, first: int) -> None:
        """A block of n tokens (fewer near the token budget): `first`, then seeded filler."""
        in_flight = sum(len(b) for b in row.blocks)
        size = min(self.block_size, row.max_new_tokens - len(row.out) - in_flight)
        if size <= 0:
            return
        row.blocks.append([first, *self.filler(row, size - 1)])
        row.sizes.append(size)

    def filler(self, row: Row, count: int) -> list[int]:
        """`count` seeded guesses for a fresh block's unknown positions."""
        if self.config.filler == "random":
            return [row.rng.randrange(self.vocab_size) for _ in range(count)]
        return row.rng.choices(row.prompt + row.out, k=count)

    def _finish(self, row: Row, last: list[int]) -> None:
        row.out.extend(last)
        row.finished = True
        row.blocks, row.sizes = [], []
        self._close_block(row, len(row.out))

    def _close_block(self, row: Row, end: int) -> None:
        """Record block 0's trajectory: its states, cut to its length, ending at its fixed point."""
        if not self.record:
            return
        fixed = row.out[row.block_start : end]
        states = [s[: len(fixed)] for s in row.states]
        if not states or states[-1] != fixed:
            states.append(fixed)  # reached through a recycled n-gram or a token emitted without a forward
        row.trajectories.append(BlockTrajectory(row.block_start, states))
        row.states = []


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a decode steps. A decode's allocations start collections, and a
    full one walks every object the process holds (torch and transformers make that hundreds of thousands): about
    170 ms, 0.4 ms a step over a 256-token multiblock decode at 64 rows (with an earlier pool that kept more
    objects). A decode makes no reference cycles of its own; what it allocates goes with its rows when it returns,
    and the collector runs again as usual after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _tree(offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[B, Q, Q] on `device`: causal among each row's draft; each candidate sees the draft's first token and its
    own prefix. `offsets` [B, Q]: each query's position past the draft's first token, as `JacobiDecoder._layout`
    lays them out (the draft 0, 1, 2, ...; each candidate 1, 2, ... again; row padding 0).

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
