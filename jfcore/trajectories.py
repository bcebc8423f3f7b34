"""Jacobi trajectories as table rows: one row per (prompt, block).

A row holds everything the packing stage needs to rebuild the block: the
context the block was decoded in (prompt + fixed points of earlier blocks),
every state the block passed through, its fixed point, and each state's
first mismatch against the fixed point. Token ids are int32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from jfcore.config import check
from jfcore.contracts import TRAJECTORY_SCHEMA
from jfcore.decoding import BlockTrajectory, DecodeConfig, decode
from jfcore.teacher_forced import anchored_blocks


def first_mismatch(state: Sequence[int], fixed_point: Sequence[int]) -> int:
    """The first index where `state` differs from `fixed_point` (their length when equal)."""
    return next((i for i, (s, f) in enumerate(zip(state, fixed_point)) if s != f), len(fixed_point))


def trajectory_rows(
    prompt_id: str,
    prompt: Sequence[int],
    generated: Sequence[int],
    blocks: Sequence[BlockTrajectory],
    block_size: int,
    model_fingerprint: str,
    tokenizer_fingerprint: str,
) -> list[dict]:
    """Rows for one decoded prompt (the output of `decode(..., record_trajectories=True)`)."""
    rows = []
    for k, block in enumerate(blocks):
        fixed = block.fixed_point
        rows.append(
            {
                "prompt_id": prompt_id,
                "block_index": k,
                "block_size": block_size,
                "prompt_length": len(prompt),
                "context": [*prompt, *generated[: block.start]],
                "states": block.states,
                "fixed_point": fixed,
                "first_mismatch": [first_mismatch(s, fixed) for s in block.states],
                "last_block": k == len(blocks) - 1,
                "model_fingerprint": model_fingerprint,
                "tokenizer_fingerprint": tokenizer_fingerprint,
            }
        )
    return rows


def rows_to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


@dataclass(frozen=True, kw_only=True)
class TrajectoryConfig:
    """How trajectories are decoded (greedy Jacobi, one block in flight)."""

    # Defaults are the decoder's own (DecodeConfig), declared once.
    block_size: int = DecodeConfig.block_size
    max_new_tokens: int = DecodeConfig.max_new_tokens
    batch_size: int = 8  # prompts decoded together by one model replica
    filler: Literal["context", "random"] = DecodeConfig.filler
    seed: int = DecodeConfig.seed
    compile: Literal["auto", "off", "inductor", "cuda_graphs"] = DecodeConfig.compile  # how forwards run

    def __post_init__(self) -> None:
        check(self.block_size >= 2, f"block_size must be >= 2 to have a trajectory, got {self.block_size}")
        check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(
            method="jacobi",
            block_size=self.block_size,
            max_new_tokens=self.max_new_tokens,
            filler=self.filler,
            seed=self.seed,
            compile=self.compile,
            record_trajectories=True,
        )


def decode_trajectories(
    model: torch.nn.Module,
    prompt_ids: Sequence[str],
    prompts: Sequence[Sequence[int]],
    config: TrajectoryConfig,
    model_fingerprint: str,
    tokenizer_fingerprint: str,
) -> pa.Table:
    """Decode `prompts` in batches and return their trajectory rows as a table."""
    rows: list[dict] = []
    decode_config = config.decode_config()
    for start in range(0, len(prompts), config.batch_size):
        batch = [list(p) for p in prompts[start : start + config.batch_size]]
        out = decode(model, batch, decode_config)
        for pid, prompt, generated, blocks in zip(prompt_ids[start:], batch, out.sequences, out.trajectories):
            rows += trajectory_rows(
                pid, prompt, generated, blocks, config.block_size, model_fingerprint, tokenizer_fingerprint
            )
    return rows_to_table(rows)


def anchored_trajectories(
    model: torch.nn.Module,
    prompt_ids: Sequence[str],
    prompts: Sequence[Sequence[int]],
    references: Sequence[Sequence[int]],
    config: TrajectoryConfig,
    model_fingerprint: str,
    tokenizer_fingerprint: str,
) -> pa.Table:
    """Rows of an anchored round: the model's own Jacobi iterates on every block of each prompt's reference
    response, whose blocks are the fixed points (jfcore/teacher_forced.py; docs/TRAINING.md, "Anchored rounds")."""
    rows: list[dict] = []
    for pid, prompt, reference in zip(prompt_ids, prompts, references, strict=True):
        blocks = anchored_blocks(model, prompt, reference, config.block_size, config.seed, config.filler)
        rows += trajectory_rows(
            pid, prompt, reference, blocks, config.block_size, model_fingerprint, tokenizer_fingerprint
        )
    return rows_to_table(rows)


def responses(files: dict[str, Sequence[str]]) -> dict[str, tuple[list[int], list[int]]]:
    """Prompt id -> (prompt, response) of the trajectory rows in `files` (shard path -> prompt ids, as
    `Selection.files()` gives them): the response is the prompt's fixed points in block order."""
    blocks: dict[str, list[dict]] = {}
    columns = ["prompt_id", "block_index", "prompt_length", "context", "fixed_point"]
    for path, ids in files.items():
        wanted = set(ids)
        for row in pq.read_table(path, columns=columns).to_pylist():
            if row["prompt_id"] in wanted:
                blocks.setdefault(row["prompt_id"], []).append(row)
    out = {}
    for pid, rows in blocks.items():
        rows.sort(key=lambda r: r["block_index"])
        if [r["block_index"] for r in rows] != list(range(len(rows))):
            raise ValueError(f"prompt {pid!r} misses blocks in {sorted(files)}: decode its trajectories again")
        out[pid] = (rows[0]["context"][: rows[0]["prompt_length"]], [t for r in rows for t in r["fixed_point"]])
    return out
