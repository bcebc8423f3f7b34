"""A row's decoding state: its prompt, output, the draft blocks in flight and what it has counted
(docs/DESIGN.md, section 1). The rules that change it are in jfcore/decoding/rules/; the C ones read and write
the fields named in `_native.ROW_FIELDS` by name (tests/unit/test_native_rules.py checks each is a field here)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from jfcore.decoding.candidates.lookup import PromptLookup
from jfcore.decoding.candidates.ngram_pool import NgramPool
from jfcore.decoding.result import BlockTrajectory
from jfcore.decoding.sampling import GREEDY, Sampling

Candidates = list[tuple[int, tuple[int, ...]]]  # (first slot, continuation tokens)


@dataclass
class Row:
    index: int
    prompt: list[int]
    max_new_tokens: int
    out: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)  # drafts in flight; blocks[0][0] is known-correct
    sizes: list[int] = field(default_factory=list)  # full size of each in-flight block
    done: int = 0  # tokens of block 0 already committed
    block_start: int = 0  # len(out) when block 0 started
    verified: int = 0  # tokens committed by forwards (these have KV)
    forwards: int = 0
    recycled: int = 0  # tokens committed through candidates (recycled or copied) beyond the draft's own run
    shared_tokens: int = 0  # prompt tokens read from a shared prefix (runner/shared_prefix.py), not prefilled
    finished: bool = False
    pool: NgramPool | None = None  # or the same pool in C (the C rules' rows)
    lookup: PromptLookup | None = None  # or the same lookup in C (the C rules' rows)
    copied: tuple[int, ...] = ()  # the prompt-lookup candidate of the forward in progress
    rng: random.Random | None = None  # filler draws, seeded per prompt
    sampling: Sampling = GREEDY  # how its tokens are chosen
    sample: int = 0  # its sample index: a key of its sampling noise (jfcore/decoding/sampling.py)
    states: list[list[int]] = field(default_factory=list)  # block 0's states, when recording
    trajectories: list[BlockTrajectory] = field(default_factory=list)

    @property
    def draft(self) -> list[int]:
        """The in-flight blocks end to end, as a new list."""
        draft: list[int] = []
        for block in self.blocks:
            draft += block
        return draft


def refill(row: Row, tokens: list[int]) -> None:
    """Lay `tokens` over the row's in-flight blocks, keeping their sizes."""
    at = 0
    for j, block in enumerate(row.blocks):
        row.blocks[j], at = tokens[at : at + len(block)], at + len(block)
