"""Decoding configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jfcore.config import check


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode. Every method is greedy and gives the same tokens.

    method: "ar" (one token per forward), "jacobi" (one block of `block_size`
    in flight) or "multiblock" (up to `num_blocks` blocks in flight plus
    rejection recycling from an n-gram pool).
    """

    method: Literal["ar", "jacobi", "multiblock"] = "jacobi"
    block_size: int = 16
    max_new_tokens: int = 256
    # How the n-1 unknown positions of a fresh block start: "context" samples
    # tokens from the prompt and text so far (the reference's choice),
    # "random" samples the vocabulary uniformly. Seeded by `seed`.
    filler: Literal["context", "random"] = "context"
    seed: int = 0
    # Multiblock + rejection recycling (docs/DESIGN.md, section 7; the published starting point: n=64, K=2, pool 4, r=0.85).
    num_blocks: int = 2
    spawn_ratio: float = 0.85
    pool_size: int = 4
    ngram_size: int = 8
    record_trajectories: bool = False

    def __post_init__(self) -> None:
        check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check(self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        check(0.0 < self.spawn_ratio <= 1.0, f"spawn_ratio must be in (0, 1], got {self.spawn_ratio}")
        check(self.pool_size >= 0, f"pool_size must be >= 0 (0 turns recycling off), got {self.pool_size}")
        check(self.ngram_size >= 2, f"ngram_size must be >= 2, got {self.ngram_size}")
        check(
            not (self.record_trajectories and self.method != "jacobi"),
            "record_trajectories needs method 'jacobi': trajectories are defined for one block in flight",
        )

    @property
    def blocks_in_flight(self) -> int:
        return self.num_blocks if self.method == "multiblock" else 1

    @property
    def recycling(self) -> bool:
        return self.method == "multiblock" and self.pool_size > 0
