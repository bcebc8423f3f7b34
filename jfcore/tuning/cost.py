"""The cost curve: seconds of one decode forward over q query positions per row, at a batch size.

A parallel decoder pays t(q) for a forward that verifies q positions and gains
the tokens it accepts; AR pays t(1) per token. How t(q)/t(1) grows decides
which widths pay, and it differs between machines (and between hosts of one
kind: matrix-multiply kernels switch at small q). So it is measured, on the
decoder's own forward path (a slot batch on a cache of `context` tokens), the
widths interleaved over rounds so that drift hits all alike, and the median
kept.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jfcore.decoding.config import DecodeConfig
from jfcore.decoding.runner.compiled import fixed_forward
from jfcore.decoding.runner.linear import faster_linear
from jfcore.decoding.runner.slots import SlotBatch, device_sync
from jfcore.decoding.sampling import greedy_argmax

DEFAULT_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48)


@dataclass(frozen=True)
class CostCurve:
    batch_size: int
    context: int  # committed tokens per row in the cache while measuring
    widths: tuple[int, ...]  # ascending, starting at 1
    seconds: tuple[float, ...]  # median seconds of one forward at each width

    def __post_init__(self) -> None:
        if not self.widths or self.widths[0] != 1 or list(self.widths) != sorted(set(self.widths)):
            raise ValueError(f"widths must be ascending and start at 1, got {self.widths}")
        if len(self.seconds) != len(self.widths):
            raise ValueError("one time per width")

    def t(self, q: float) -> float:
        """Seconds of a forward over q positions: linear between measured widths, and beyond the widest along the
        last segment (never below the widest's time)."""
        w, s = self.widths, self.seconds
        if q <= w[0]:
            return s[0]
        i = min(bisect.bisect_left(w, q), len(w) - 1)
        lo, hi = max(i - 1, 0), i
        if w[hi] == w[lo]:
            return s[hi]
        slope = (s[hi] - s[lo]) / (w[hi] - w[lo])
        return max(s[lo] + slope * (q - w[lo]), s[lo] if q <= w[hi] else s[-1])

    def ratio(self, q: float) -> float:
        return self.t(q) / self.seconds[0]

    def as_dict(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "context": self.context,
            "widths": list(self.widths),
            "seconds": list(self.seconds),
            "ratio": [round(t / self.seconds[0], 4) for t in self.seconds],
        }


@torch.inference_mode()
def measure_curve(
    model: torch.nn.Module,
    batch_size: int = 1,
    widths: Sequence[int] = DEFAULT_WIDTHS,
    context: int = 256,
    rounds: int = 5,
    seed: int = 0,
    compile: str = DecodeConfig.compile,
    linear: str = DecodeConfig.linear,
) -> CostCurve:
    """Median time of one forward of `batch_size` rows x q new positions on a `context`-token cache, for each q,
    run the way decoding with `compile` and `linear` runs it."""
    widths = tuple(sorted(set(widths) | {1}))
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(seed)
    fixed = fixed_forward(model, compile)
    slots = SlotBatch(
        model, batch_size, compact=False, fixed_forward=fixed, linear=None if fixed else faster_linear(model, linear)
    )
    prompt = torch.randint(0, vocab, (batch_size, context), generator=generator)
    valid = torch.ones(batch_size, context, dtype=torch.bool)
    slots.forward(prompt, valid, torch.arange(context).expand(batch_size, -1), logits_to_keep=1)
    slots.keep(valid)
    sync = device_sync(slots.device)
    times: dict[int, list[float]] = {q: [] for q in widths}
    for r in range(rounds + 1):  # round 0 warms every shape up and is not kept
        for q in widths[r % len(widths) :] + widths[: r % len(widths)]:
            tokens = torch.randint(0, vocab, (batch_size, q), generator=generator)
            positions = torch.arange(context, context + q).expand(batch_size, -1)
            sync()
            start = time.perf_counter()
            logits = slots.forward(tokens, torch.ones(batch_size, q, dtype=torch.bool), positions)
            greedy_argmax(logits).tolist()  # the decoder reads its predictions back: part of the step's cost
            seconds = time.perf_counter() - start
            slots.keep(torch.zeros(batch_size, q, dtype=torch.bool))  # drop them: the cache stays at `context`
            if r:
                times[q].append(seconds)
    return CostCurve(batch_size, context, widths, tuple(statistics.median(times[q]) for q in widths))
