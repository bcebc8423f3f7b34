"""What a decode call returns: tokens, statistics and optional trajectories."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Per-call statistics.

    TPF (tokens per forward) = new tokens / decode forwards, where a decode
    forward is any model call after the prefill (the prefill is excluded).
    A batched forward counts once for every row it serves, so TPF is the
    per-sequence figure. TPS counts wall time with the prefill included;
    `decode_tps` leaves it out.
    """

    new_tokens: int = 0
    decode_forwards: int = 0
    forward_calls: int = 0  # model calls after the prefill, however many rows each served
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    forward_seconds: float = 0.0  # decode time spent inside model forward calls
    # Tokens accepted through candidates (recycled n-grams, prompt lookup) beyond the draft's own run.
    recycled_tokens: int = 0
    tokens_per_row: list[int] = field(default_factory=list)
    forwards_per_row: list[int] = field(default_factory=list)

    @property
    def tpf(self) -> float:
        return self.new_tokens / max(self.decode_forwards, 1)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tps(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def overhead(self) -> float:
        """Share of decode wall time spent outside model forwards (the decoder's own cost)."""
        return 1.0 - self.forward_seconds / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        base = {k: v for k, v in vars(self).items()}
        return base | {"tpf": self.tpf, "tps": self.tps, "decode_tps": self.decode_tps, "overhead": self.overhead}


@dataclass
class BlockTrajectory:
    """Every state one block passed through, from its first draft to its fixed point.

    The block's context is the prompt followed by `generated[:start]` of its
    row. `states[-1]` is the fixed point. A row's last block may be shorter
    than the block size (it ended at EOS or max_new_tokens); then every state
    is cut to that length.
    """

    start: int
    states: list[list[int]]

    @property
    def fixed_point(self) -> list[int]:
        return self.states[-1]


@dataclass
class StepEvent:
    """Reported after every decode forward (for tests and progress hooks)."""

    step: int
    rows: list[int]  # input row indices served by this forward
    accepted: list[int]  # tokens committed per served row
    committed: list[int]  # prompt + committed tokens per served row (tokens with KV)
    cache_tokens: list[int]  # valid cache slots per served row
    widths: list[int] = field(default_factory=list)  # query positions per served row (draft and candidates)


@dataclass
class DecodeOutput:
    sequences: list[list[int]]  # generated token ids per prompt (prompt excluded), EOS kept
    stats: DecodeStats
    trajectories: list[list[BlockTrajectory]] | None = None
