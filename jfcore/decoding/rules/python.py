"""The decoding rules, row by row in Python: the reference that defines the method here, and the tests' oracle
(docs/DESIGN.md, sections 1 and 7). jfcore/decoding/rules/native.py runs the same rules in C.

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
latest earlier occurrence of the row's last tokens (jfcore/decoding/candidates/lookup.py).

Every committed token is checked against the model's own argmax, so the
output equals greedy autoregressive decoding exactly, whatever the drafts.
AR decoding is the special case of one block of size 1. A sampled row reads
"the row's keyed sample" for "argmax" (jfcore/decoding/sampling.py): again a
function of the prefix, so the output equals sequential sampling exactly.

A step is `layout` (every row's forward input), the runner's forward, then `commit` (the choice at every query,
acceptance, the draft update, and which cache slots each row keeps). `start` begins rows from their prefill.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

import torch

from jfcore.decoding.candidates.lookup import PromptLookup
from jfcore.decoding.candidates.ngram_pool import NgramPool
from jfcore.decoding.config import DecodeConfig
from jfcore.decoding.result import BlockTrajectory
from jfcore.decoding.row import Candidates, Row, refill
from jfcore.decoding.rules.layout import Kept, StepInput
from jfcore.decoding.runner.slots import host_tensor
from jfcore.decoding.sampling import Sampling, choose

Generated = Callable[[], torch.Tensor]  # () -> [B, Q]: the generated position each query predicts


class PythonRules:
    """What a step does to each row, and how rows start and end; one instance per decoder."""

    pool_type: type = NgramPool  # a row's n-gram pool and prompt lookup (NativeRules: the same in C)
    lookup_type: type = PromptLookup

    def __init__(self, config: DecodeConfig, eos_token_ids: Collection[int], pad_token_id: int):
        self.config = config
        self.block_size = 1 if config.method == "ar" else config.block_size
        self.record = config.record_trajectories
        self.eos = frozenset(eos_token_ids)
        self.pad = pad_token_id
        self.vocab_size: int | None = None  # the logits' width, known from the first prefill (`start`)

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
        cfg = self.config
        settings, sample = sampling or (cfg.sampling, index)
        if self.record and not settings.greedy:
            raise ValueError("recorded trajectories are greedy fixed points: a sampled row cannot be recorded")
        row = Row(
            index,
            list(prompt),
            max_new_tokens=max_new_tokens or cfg.max_new_tokens,
            rng=random.Random(f"{cfg.seed}:{list(prompt)}"),
            sampling=settings,
            sample=sample,
        )
        if cfg.recycling:
            row.pool = self.pool_type(cfg.pool_size, cfg.ngram_size)
        if cfg.lookup_tokens:
            row.lookup = self.lookup_type(cfg.lookup_ngram, cfg.lookup_tokens, row.prompt)
        return row

    def start(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Begin `rows` from their prefill's logits at each prompt's last position ([B, 1, V])."""
        self.vocab_size = logits.shape[-1]
        first = self.choose(logits, rows, lambda: torch.zeros(len(rows), 1, dtype=torch.long))[:, 0].tolist()
        for row, token in zip(rows, first):
            self.begin(row, token)

    def begin(self, row: Row, first: int) -> None:
        """Begin `row` from its known first token: finished at once, or its first block opened."""
        self._carry_on(row, first, guess=first, progress=0)

    def choose(
        self, logits: torch.Tensor, rows: list[Row], generated: Generated, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, Q] host tensor of each row's choice at each query (greedy, or sampled: jfcore/decoding/sampling.py);
        `generated()` [B, Q]: the generated position of the token each query predicts (built only for sampling);
        `valid`: the real queries, when `logits` holds only theirs."""
        return choose(logits, [r.sampling for r in rows], [r.sample for r in rows], generated, valid)

    # -- one step: layout, (the forward), commit ---------------------------------------------------

    def layout(self, rows: list[Row]) -> StepInput:
        """Every row's forward input. Built as Python lists that become tensors in one call each (through numpy:
        `host_tensor`): per-row tensor writes, or torch.tensor on lists, would cost more than the rest of the step's
        host work."""
        layouts = [self._layout(row) for row in rows]
        lengths = [len(inputs) for inputs, _, _ in layouts]
        width = max(lengths)
        pad = self.pad
        tokens = host_tensor([inputs + [pad] * (width - n) for (inputs, _, _), n in zip(layouts, lengths)])
        # Offsets from draft[0]'s position (row padding: 0), then every row's own in one tensor addition.
        offsets = host_tensor([o + [0] * (width - n) for (_, o, _), n in zip(layouts, lengths)])
        committed = host_tensor([len(row.prompt) + row.verified for row in rows])  # draft[0]'s position, no sync
        valid = torch.arange(width) < host_tensor(lengths)[:, None]
        # A row whose draft is one token and that has one candidate is a plain causal chain.
        tree = any(cands and (len(inputs) - len(cands[0][1]) > 1 or len(cands) > 1) for inputs, _, cands in layouts)
        return StepInput(tokens, valid, offsets + committed[:, None], offsets, tree, layouts)

    def commit(self, rows: list[Row], step: StepInput, logits: torch.Tensor) -> Kept:
        """Choose at every query, accept, update every row's draft; the slots each row keeps."""

        def generated() -> torch.Tensor:
            """What each query predicts: the token after it, whose generated position counts from draft[0]'s."""
            return step.offsets + host_tensor([len(row.out) + 1 for row in rows])[:, None]

        predictions = self.choose(logits, rows, generated, step.valid).tolist()  # one host sync per forward
        kept = [
            self._verify(row, pred, cands, inputs[: cands[0][0]] if cands else inputs)
            for row, pred, (inputs, _, cands) in zip(rows, predictions, step.state)
        ]
        # Kept slots become each row's first ones: a committed candidate's move up to follow the row's first slot.
        gapped = (b for b, slots in enumerate(kept) if slots and slots[-1] >= len(slots))
        moves = [(b, s, i) for b in gapped for i, s in enumerate(kept[b]) if s != i]
        return Kept(host_tensor([len(slots) for slots in kept]), host_tensor(moves) if moves else None)

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
        if self.config.rolling and row.blocks:
            self._top_up(row, guess)
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
            self.close_block(row, row.block_start + size)
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

    def _top_up(self, row: Row, guess: int) -> None:
        """`rolling`: the window grows back to n (fewer near the token budget): the model's token after the whole
        draft, then seeded filler for the rest. With one token committed it is all the model's own."""
        block = row.blocks[0]
        room = min(self.block_size, row.max_new_tokens - len(row.out)) - len(block)
        if room > 0:
            block += [guess, *self.filler(row, room - 1)] if room > 1 else [guess]

    def _open_block(self, row: Row, first: int) -> None:
        """A block of n tokens (fewer near the token budget): `first`, then seeded filler."""
        in_flight = sum(len(b) for b in row.blocks)
        size = min(self.block_size, row.max_new_tokens - len(row.out) - in_flight)
        if size <= 0:
            return
        row.blocks.append([first, *self.filler(row, size - 1)])
        row.sizes.append(size)

    def _finish(self, row: Row, last: list[int]) -> None:
        row.out.extend(last)
        row.finished = True
        row.blocks, row.sizes = [], []
        self.close_block(row, len(row.out))

    # -- called by the C rules too (rules/native.py: CALLBACKS) ----------------------------

    def filler(self, row: Row, count: int) -> list[int]:
        """`count` seeded guesses for a fresh block's unknown positions."""
        if self.config.filler == "random":
            return [row.rng.randrange(self.vocab_size) for _ in range(count)]
        return row.rng.choices(row.prompt + row.out, k=count)

    def close_block(self, row: Row, end: int) -> None:
        """Record block 0's trajectory: its states, cut to its length, ending at its fixed point."""
        if not self.record:
            return
        fixed = row.out[row.block_start : end]
        states = [s[: len(fixed)] for s in row.states]
        if not states or states[-1] != fixed:
            states.append(fixed)  # reached through a recycled n-gram or a token emitted without a forward
        row.trajectories.append(BlockTrajectory(row.block_start, states))
        row.states = []
