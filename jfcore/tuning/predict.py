"""Predicted speedup of a decoding configuration over AR, from the cost curve and the measured acceptance.

For every tuning prompt the configuration's decode is replayed along the
prompt's greedy output, without the model: at each forward the row verifies
its draft (n positions, or the multiblock family's recorded width) and a
prompt-lookup candidate (replayed exactly, `jfcore.decoding.candidates.lookup`), and
commits the longer verified run. The draft's own run is drawn from what the
family's recorded forwards accepted (capped at n); each replay is repeated
with several seeds and averaged. Then

    speedup = (prefill + N (t(1) + h_AR)) / (prefill + F (E[t(w)] + h))

with N tokens, F forwards, t the measured cost curve of the batch-size
bucket, w the forward's width (at batch B the widest of B rows) and h the
decoder's own time per step. TPF = N / F. This is the issue's formula
TPF / (t(w_eff)/t(1) + h/t(1)) with the prefill kept in, since benchmarks time it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from jfcore.decoding import DecodeConfig
from jfcore.decoding.candidates.lookup import PromptLookup
from jfcore.tuning.acceptance import Acceptance
from jfcore.tuning.cost import CostCurve

REPEATS = 4


@dataclass(frozen=True)
class Prediction:
    config: DecodeConfig
    tpf: float
    mean_width: float
    speedup: float

    def as_dict(self) -> dict:
        return {"tpf": round(self.tpf, 4), "mean_width": round(self.mean_width, 3), "speedup": round(self.speedup, 4)}


def family(config: DecodeConfig) -> str:
    """Which recorded drafts a configuration draws its own runs from."""
    if config.method == "multiblock":
        return "multiblock"
    if config.method == "ar" or config.block_size == 1:
        return "ar"
    return "rolling" if config.rolling else "jacobi"


def replay_widths(config: DecodeConfig, acceptance: Acceptance, seed: int) -> tuple[int, list[int]]:
    """(tokens, widths of every row-forward) of `config` replayed on every tuning prompt."""
    rng = random.Random(seed)
    kind = family(config)
    steps = None if kind == "ar" else acceptance.steps_for(kind, config.block_size)
    tokens, widths = 0, []
    for prompt, output in zip(acceptance.prompts, acceptance.greedy):
        lookup = PromptLookup(config.lookup_ngram, config.lookup_tokens, prompt) if config.lookup_tokens else None
        known = 1 if output else 0
        while known < len(output):
            if steps is None:
                own, width = 1, 1
            else:
                i = rng.randrange(len(steps.accepted))
                own = steps.accepted[i] if kind == "multiblock" else min(steps.accepted[i], config.block_size)
                width = steps.widths[i] if kind == "multiblock" else config.block_size
            held, copied = 0, []
            if lookup is not None:
                room = len(output) - known
                copied = lookup.propose(output[known - 1], min(room, width - 1) if config.lookup_within else room)
                while held < len(copied) and copied[held] == output[known + held]:
                    held += 1
                lookup.update(len(copied), held)
                if config.lookup_within and copied:
                    own = 1  # the copy took the place of the draft's own guesses
            advance = min(max(own, 1 + held), len(output) - known + 1)
            if lookup is not None:
                lookup.extend(output[known - 1 : known - 1 + advance])
            widths.append(width if config.lookup_within else width + len(copied))
            known += advance
        tokens += len(output)
    return tokens, widths


def predict(
    config: DecodeConfig, acceptance: Acceptance, curve: CostCurve, host_seconds: float, repeats: int = REPEATS
) -> Prediction:
    """The configuration's predicted TPF, mean width and speedup over AR at the curve's batch size."""
    b = curve.batch_size
    prefill = sum(acceptance.prefill_seconds)
    t1 = curve.seconds[0]
    tokens = sum(map(len, acceptance.greedy))
    ar_seconds = prefill + (tokens - len(acceptance.greedy)) * (t1 + acceptance.ar_host_seconds * b) / b
    speedups, tpfs, means = [], [], []
    for r in range(repeats if family(config) != "ar" else 1):
        n, widths = replay_widths(config, acceptance, seed=r)
        rng = random.Random(1000 + r)
        # At batch b a forward is as wide as its widest row: b row-forwards share one forward.
        forward = sum(curve.t(max(rng.choice(widths) for _ in range(b))) for _ in range(len(widths))) / len(widths)
        seconds = prefill + len(widths) * (forward + host_seconds * b) / b
        speedups.append(ar_seconds / seconds)
        tpfs.append(n / max(len(widths), 1))
        means.append(sum(widths) / max(len(widths), 1))
    k = len(speedups)
    return Prediction(config, sum(tpfs) / k, sum(means) / k, sum(speedups) / k)
