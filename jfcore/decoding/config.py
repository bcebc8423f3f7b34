"""Decoding configuration."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from jfcore.config import check
from jfcore.decoding.sampling import Sampling

COMPILE_MODES = ("auto", "off", "inductor", "cuda_graphs")
LINEAR_MODES = ("auto", "torch")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How to decode. Every method is greedy and gives the same tokens.

    method: "ar" (one token per forward), "jacobi" (one block of `block_size`
    in flight) or "multiblock" (up to `num_blocks` blocks in flight plus
    rejection recycling from an n-gram pool). `rolling` (jacobi): the block
    never closes.
    """

    method: Literal["ar", "jacobi", "multiblock"] = "jacobi"
    block_size: int = 16
    max_new_tokens: int = 256
    # How the n-1 unknown positions of a fresh block start: "context" samples
    # tokens from the prompt and text so far (the reference's choice),
    # "random" samples the vocabulary uniformly. Seeded by `seed`.
    filler: Literal["context", "random"] = "context"
    seed: int = 0
    # Jacobi only. False: a block that reached its fixed point is followed by a fresh one (the known next token and
    # n-1 filler), so every block spends a forward on filler. True: the block is a window that never closes; after
    # each forward it is topped up to n with the model's own token after the whole draft, then filler for what is
    # still missing (docs/DESIGN.md, "The rolling window"). Trained drafts gain from it; filler guesses barely do.
    rolling: bool = False
    # Multiblock + rejection recycling (docs/DESIGN.md, section 7; the published starting point: n=64, K=2, pool 4, r=0.85).
    num_blocks: int = 2
    spawn_ratio: float = 0.85
    pool_size: int = 4
    ngram_size: int = 8
    # Prompt lookup (any method): each forward also verifies up to `lookup_tokens` tokens copied from after the
    # latest earlier occurrence of the row's last 1..`lookup_ngram` tokens in its prompt and output. 0 turns it off.
    lookup_tokens: int = 0
    lookup_ngram: int = 3
    # True: the copied text replaces the draft's unverified guesses (a forward keeps the block's width) instead of
    # adding positions of its own; for blocks of 2 or more, where width costs more than a guess is worth.
    lookup_within: bool = False
    record_trajectories: bool = False
    # Sampling (jfcore/decoding/sampling.py): temperature 0 is greedy. Otherwise temperature, then top-k (0: off), then
    # top-p (1: off), and Gumbel noise keyed by (sample_seed, sample index, position); a prompt's sample index is its
    # place in the `decode` call. Every method returns the tokens sequential sampling with the same keys returns.
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    sample_seed: int = 0
    # Decode forwards at fixed shapes (docs/DESIGN.md, section 1): "cuda_graphs" (a CUDA model only) replays one
    # CUDA graph per shape bucket (jfcore/decoding/runner/graphs.py), captured in milliseconds; "inductor" runs a model
    # compiled with torch.compile (frozen weights; jfcore/decoding/runner/compiled.py), each new shape compiled once per
    # process (tens of seconds on a CPU), so it pays on long runs only. "auto", by measurement: CUDA graphs on a
    # CUDA model (2.6-5.2x batch-1 decoding on an H200), eager elsewhere.
    compile: Literal["auto", "off", "inductor", "cuda_graphs"] = "auto"
    # Linear layers of eager forwards on a CPU (jfcore/decoding/runner/linear.py): "auto" computes a product over a few
    # rows as weight x inputs^T wherever that measures faster than torch's own kernel for its shape and row count
    # (it does on some hosts' matrix libraries: forwards over 2-4 positions then cost what one costs), "torch"
    # always leaves them to torch.
    linear: Literal["auto", "torch"] = "auto"
    # Rows whose prompts open with at least this many equal tokens share that prefix's KV, prefilled once
    # (jfcore/decoding/runner/shared_prefix.py; eager forwards of an SDPA model only). 0 turns sharing off.
    share_prefix_tokens: int = 64

    def __post_init__(self) -> None:
        check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check(self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        check(0.0 < self.spawn_ratio <= 1.0, f"spawn_ratio must be in (0, 1], got {self.spawn_ratio}")
        check(self.pool_size >= 0, f"pool_size must be >= 0 (0 turns recycling off), got {self.pool_size}")
        check(self.ngram_size >= 2, f"ngram_size must be >= 2, got {self.ngram_size}")
        check(
            self.lookup_tokens >= 0, f"lookup_tokens must be >= 0 (0 turns prompt lookup off), got {self.lookup_tokens}"
        )
        check(
            self.share_prefix_tokens >= 0,
            f"share_prefix_tokens must be >= 0 (0 turns prefix sharing off), got {self.share_prefix_tokens}",
        )
        check(self.lookup_ngram >= 1, f"lookup_ngram must be >= 1, got {self.lookup_ngram}")
        check(
            not self.lookup_within
            or (self.lookup_tokens and self.blocks_in_flight * self.block_size > 1 and self.method != "ar"),
            "lookup_within needs lookup_tokens > 0 and a draft of 2 or more tokens (method jacobi or multiblock)",
        )
        check(
            not self.rolling or (self.method == "jacobi" and self.block_size > 1),
            f"rolling needs method 'jacobi' and block_size >= 2, got method {self.method!r}, block_size {self.block_size}",
        )
        check(
            self.compile in COMPILE_MODES,
            f"compile must be one of {', '.join(map(repr, COMPILE_MODES))}, got {self.compile!r}",
        )
        check(
            self.linear in LINEAR_MODES,
            f"linear must be one of {', '.join(map(repr, LINEAR_MODES))}, got {self.linear!r}",
        )
        Sampling(self.temperature, self.top_k, self.top_p, self.sample_seed)  # checks the sampling settings
        check(
            not (self.record_trajectories and self.temperature > 0),
            "record_trajectories needs temperature 0: trajectories are greedy fixed points",
        )
        check(
            not (self.record_trajectories and (self.method != "jacobi" or self.lookup_tokens or self.rolling)),
            "record_trajectories needs method 'jacobi' without prompt lookup or rolling: trajectories are the states "
            "of one block in flight, from its filler to its fixed point",
        )

    def describe(self) -> str:
        """The configuration in a few characters: ar, ar+L6g2 (6 copied tokens beside the draft, 2-gram match),
        jacobi n4inL3g3 (3 copied tokens within a 4-token draft), jacobi n4r (rolling), multiblock n16 K2 p4."""
        if self.method == "ar" or (self.method == "jacobi" and self.block_size == 1):
            text = "ar"
        elif self.method == "jacobi":
            text = f"jacobi n{self.block_size}" + ("r" if self.rolling else "")
        else:
            text = f"multiblock n{self.block_size} K{self.num_blocks} p{self.pool_size}"
        where = "in" if self.lookup_within else "+"
        text += f"{where}L{self.lookup_tokens}g{self.lookup_ngram}" if self.lookup_tokens else ""
        if self.temperature > 0:  # sampled: T0.7, then k50 and p0.9 when set
            text += f" T{self.temperature:g}" + (f" k{self.top_k}" if self.top_k else "")
            text += f" p{self.top_p:g}" if self.top_p < 1 else ""
        return text

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.sample_seed)

    @functools.cached_property  # read for every row at every step of a row-by-row decode
    def blocks_in_flight(self) -> int:
        return self.num_blocks if self.method == "multiblock" else 1

    @property
    def recycling(self) -> bool:
        return self.method == "multiblock" and self.pool_size > 0
