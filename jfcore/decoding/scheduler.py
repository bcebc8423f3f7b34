"""The scheduler: which rows decode together (continuous batching), one forward per step.

Prompts are admitted between forwards (a prefill of their own, then their cache slots join the batch's),
finished and cancelled rows leave. A step is three calls: the rules lay out every row's forward input
(jfcore/decoding/rules/), the model runner's slot batch runs the forward (jfcore/decoding/runner/), and the rules
commit what it verified, which says what each row keeps of its new cache slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from jfcore.decoding.result import StepEvent
from jfcore.decoding.row import Row
from jfcore.decoding.rules.python import PythonRules
from jfcore.decoding.runner import shared_prefix
from jfcore.decoding.runner.model_runner import ModelRunner
from jfcore.decoding.runner.slots import SlotBatch, left_pad
from jfcore.decoding.sampling import Sampling


class Scheduler:
    """Rows that decode together, one forward per step (continuous batching).

    Prompts join between forwards (`add`: a prefill of their own, then their cache slots are merged into the
    batch's), finished and cancelled rows leave, and every row's tokens are its own output (greedy, or sampled
    with its own keyed noise) whatever else shares the batch: each row attends only to its own valid slots at its
    own positions. Every row's `out` and `forwards` are current after each step (a server streams them).
    """

    def __init__(self, runner: ModelRunner, rules: PythonRules, on_step: Callable[[StepEvent], None] | None = None):
        self.runner = runner
        self.rules = rules
        self.on_step = on_step
        self.rows: list[Row] = []
        self.slots: SlotBatch | None = None
        self.steps = 0  # decode forwards run
        self.forward_seconds = 0.0  # time inside those forwards
        self._admitted = 0

    @property
    def joinable(self) -> bool:
        """Whether new rows can join now (always once the batch is empty; caches with special layers cannot merge)."""
        return self.slots is None or self.slots.mergeable

    @torch.inference_mode()
    def add(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int | None] | None = None,
        sampling: Sequence[tuple[Sampling, int] | None] | None = None,
    ) -> list[Row]:
        """Prefill `prompts` and let them join the batch. Returns their rows, some perhaps finished already
        (a first token that is EOS, or a budget of one token). `sampling`: per prompt, its own sampling settings
        and sample index (default: the decoder's settings, and the row's admission number)."""
        rules, runner = self.rules, self.runner
        limits = list(max_new_tokens) if max_new_tokens is not None else [None] * len(prompts)
        keys = list(sampling) if sampling is not None else [None] * len(prompts)
        new = [
            rules.new_row(self._admitted + i, list(map(int, p)), m, k)
            for i, (p, m, k) in enumerate(zip(prompts, limits, keys, strict=True))
        ]
        self._admitted += len(new)
        # Identical prompts (a request's n choices) are prefilled once; their rows then copy its cache row.
        firsts: dict[tuple[int, ...], int] = {}
        source = [firsts.setdefault(tuple(r.prompt), len(firsts)) for r in new]
        slots = runner.slots(len(firsts))
        # Prompts that open alike prefill only what follows their shared prefix, on top of it.
        slots.shared = self._shared_prefixes(list(firsts))
        skip = slots.shared.lengths if slots.shared is not None else [0] * len(firsts)
        tokens, valid, positions = left_pad([p[n:] for p, n in zip(firsts, skip)], rules.pad)
        logits = slots.forward(tokens, valid, positions + torch.tensor(skip)[:, None], **runner.prefill_kwargs)
        slots.keep(valid)
        for row, i in zip(new, source):
            row.shared_tokens = skip[i]
        if len(firsts) < len(new):
            slots.select_rows(source)
            logits = logits[torch.tensor(source, device=logits.device)]
        rules.start(new, logits[:, -1:])
        staying = [i for i, row in enumerate(new) if not row.finished]
        if staying:
            if len(staying) < len(new):
                slots.select_rows(staying)
            if self.slots is None:
                self.slots = slots
            else:
                self.slots.extend(slots)
            self.rows += [new[i] for i in staying]
        return new

    def _shared_prefixes(self, prompts: list[tuple[int, ...]]) -> shared_prefix.PrefixRows | None:
        """Which shared prefix each new prompt reads: the longest one of the batch's it runs past, else one made for
        prompts that open with the same `share_prefix_tokens` tokens (their longest common prefix), taken from a
        live row's cache where one opens alike too, else prefilled once."""
        minimum = self.runner.share_prefix_tokens
        if not self.runner.shares_prefixes(prompts):
            return None
        live = self.slots.shared if self.slots is not None else None
        chosen = [live.find(p) if live is not None else None for p in prompts]
        openings: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            if chosen[i] is None and len(p) > minimum:
                openings.setdefault(p[:minimum], []).append(i)
        for opening, members in openings.items():
            donor = self._row_opening_with(opening)
            group = [prompts[i] for i in members] + ([self.rows[donor].prompt] if donor is not None else [])
            n = shared_prefix.common_prefix(group) if len(group) > 1 else 0
            if n < minimum:
                continue
            tokens = prompts[members[0]][:n]
            if donor is not None:
                prefix = self.slots.prefix_of_row(donor, tokens)
            else:
                prefix = self.runner.prefill_prefix(tokens)
            for i in members:
                chosen[i] = prefix
        return shared_prefix.rows_reading(chosen)

    def _row_opening_with(self, opening: tuple[int, ...]) -> int | None:
        """A live row that reads no shared prefix and whose prompt opens with `opening`, if any (its first slots
        then hold that opening's KV)."""
        if self.slots is None or not self.slots.mergeable:
            return None
        reads = self.slots.shared.of_row if self.slots.shared is not None else [-1] * len(self.rows)
        n = len(opening)
        return next((b for b, row in enumerate(self.rows) if reads[b] < 0 and tuple(row.prompt[:n]) == opening), None)

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One forward for every row. Returns the rows that finished; they have left the batch."""
        rows, slots = self.rows, self.slots
        before = slots.forward_seconds
        step = self.rules.layout(rows)
        logits = slots.forward(step.tokens, step.valid, step.positions, step.mask(slots.device), packed=True)
        kept = self.rules.commit(rows, step, logits)
        slots.keep_first(kept.counts, kept.moves)
        self.forward_seconds += slots.forward_seconds - before
        if self.on_step is not None:
            committed = [len(r.prompt) + r.verified for r in rows]
            lengths = step.valid.sum(1).tolist()
            event = StepEvent(
                self.steps, [r.index for r in rows], kept.counts.tolist(), committed, slots.cached_tokens(), lengths
            )
            self.on_step(event)
        self.steps += 1
        return self.remove([row for row in self.rows if row.finished])

    @torch.inference_mode()  # the cache's storage is written in place (an inference tensor)
    def remove(self, leaving: list[Row]) -> list[Row]:
        """Take rows out of the batch (finished, or cancelled by their caller)."""
        if not leaving:
            return leaving
        ids = {id(row) for row in leaving}
        keep = fill_from_the_end(len(self.rows), {i for i, row in enumerate(self.rows) if id(row) in ids})
        if len(keep) < len(self.rows):
            if keep:
                self.slots.select_rows(keep)
            else:
                self.slots = None
            self.rows = [self.rows[i] for i in keep]
        if self.slots is None or self.slots.shared is None:
            self.runner.restore()  # no prefix left to read: the model's own attention again
        return leaving


def fill_from_the_end(rows: int, leaving: set[int]) -> list[int]:
    """The rows that stay, in their new order: each place a row leaves is taken by one of the last rows, so the
    cache moves as many rows as leave from below the new end, and the rest stay put."""
    staying = rows - len(leaving)
    order = list(range(staying))
    movers = (i for i in range(staying, rows) if i not in leaving)
    for hole in sorted(i for i in leaving if i < staying):
        order[hole] = next(movers)
    return order
