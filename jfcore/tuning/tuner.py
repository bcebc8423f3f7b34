"""The tuner: the fastest lossless decoding configuration for this model on this machine, per batch-size bucket.

1. The cost curve t(q) of one forward over q positions, per bucket (`cost`).
2. Acceptance on the tuning split: greedy outputs (prompt lookup replays on
   them exactly), and the model's own Jacobi and multiblock drafts (`acceptance`).
3. A predicted speedup for every configuration on the grid of block size n,
   candidate length, lookup n-gram and family (`predict`): replayed, not decoded.
4. The best few predictions confirmed by real decoding, interleaved with AR,
   the median of several rounds; AR is always among them, so the choice is
   never slower than AR as measured.
docs/DESIGN.md (section 12) has the model and its limits.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from jfcore.config import check
from jfcore.decoding import DecodeConfig
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.runner.slots import device_sync
from jfcore.machine import MachineIdentity, this_machine
from jfcore.tuning.acceptance import Acceptance, greedy_pass, record_drafts
from jfcore.tuning.cost import DEFAULT_WIDTHS, CostCurve, measure_curve
from jfcore.tuning.predict import Prediction, family, predict
from jfcore.tuning.replay import simulate
from jfcore.tuning.split import DEFAULT_SPLIT, TuningSet


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    batch_sizes: tuple[int, ...] = (1,)  # buckets: a batch of b rows decodes with the smallest bucket >= b
    split: tuple[TuningSet, ...] = DEFAULT_SPLIT
    max_new_tokens: int = 96  # per tuning prompt
    block_sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)  # n on the grid (1: no draft of the model's own)
    lookup_tokens: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20)  # longest prompt-lookup candidate
    lookup_ngrams: tuple[int, ...] = (1, 2, 3)
    record_block_size: int | None = None  # drafts recorded at this n (default: the trained block size, else 16)
    multiblock: bool = True  # also consider multiblock (2 blocks, pool 4) at the recorded block size
    rolling: bool = True  # also consider rolling Jacobi windows (DecodeConfig.rolling) at every n
    widths: tuple[int, ...] = DEFAULT_WIDTHS  # cost-curve widths
    curve_rounds: int = 5
    confirm: int = 3  # the best predictions confirmed by decoding (AR is confirmed too)
    confirm_prompts: int = 4  # tuning prompts decoded per confirmation round, spread over the split's sources
    rounds: int = 3  # confirmation rounds, interleaved; the median counts
    batch_size: int = 8  # rows per batch while measuring acceptance
    max_minutes: float = 8.0  # past it, optional work is skipped (multiblock's record, further buckets), each said

    def __post_init__(self) -> None:
        check(bool(self.batch_sizes) and min(self.batch_sizes) >= 1, f"batch_sizes: >= 1 each, got {self.batch_sizes}")
        check(bool(self.block_sizes) and min(self.block_sizes) >= 1, f"block_sizes: >= 1 each, got {self.block_sizes}")
        check(min(self.lookup_tokens, default=0) >= 0, f"lookup_tokens: >= 0 each, got {self.lookup_tokens}")
        check(min(self.lookup_ngrams, default=1) >= 1, f"lookup_ngrams: >= 1 each, got {self.lookup_ngrams}")
        check(self.rounds >= 3, f"rounds: the median needs >= 3 rounds, got {self.rounds}")
        check(self.confirm >= 1, f"confirm: >= 1, got {self.confirm}")
        check(self.max_new_tokens >= 8, f"max_new_tokens: >= 8, got {self.max_new_tokens}")
        check(self.confirm_prompts >= 1, f"confirm_prompts: >= 1, got {self.confirm_prompts}")
        check(self.max_minutes > 0, f"max_minutes: > 0, got {self.max_minutes}")


@dataclass(frozen=True)
class Confirmed:
    config: DecodeConfig
    predicted: float  # predicted speedup over AR
    measured: float  # median over rounds of AR seconds / its seconds
    rounds: tuple[float, ...]
    tpf: float  # measured
    exact: bool  # every output equal to AR's

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


@dataclass(frozen=True)
class BucketResult:
    batch_size: int
    curve: CostCurve
    chosen: Confirmed
    confirmed: tuple[Confirmed, ...]
    surface: tuple[Prediction, ...]  # every predicted configuration, best first


@dataclass
class TuneResult:
    machine: MachineIdentity
    acceptance: Acceptance
    buckets: list[BucketResult] = field(default_factory=list)
    seconds: float = 0.0


def grid(config: TuneConfig, record_n: int) -> list[DecodeConfig]:
    """Every configuration the tuner predicts: (family, n, candidate length, lookup n-gram)."""
    out = []
    lookups = [(0, 3)] + [(t, g) for t in config.lookup_tokens if t > 0 for g in config.lookup_ngrams]
    windows = (False, True) if config.rolling else (False,)
    for n in sorted({n for n in config.block_sizes if n <= record_n}):
        for tokens, ngram in lookups:
            if n == 1:
                out.append(DecodeConfig(method="ar", block_size=1, lookup_tokens=tokens, lookup_ngram=ngram))
                continue
            for rolling in windows:
                jacobi = DecodeConfig(
                    method="jacobi", block_size=n, lookup_tokens=tokens, lookup_ngram=ngram, rolling=rolling
                )
                out.append(jacobi)
                if 0 < tokens < n:  # the copy in place of the draft's guesses: the width stays n
                    out.append(replace(jacobi, lookup_within=True))
    if config.multiblock and record_n > 1:
        for tokens, ngram in lookups:
            out.append(
                DecodeConfig(
                    method="multiblock",
                    block_size=record_n,
                    num_blocks=2,
                    pool_size=4,
                    lookup_tokens=tokens,
                    lookup_ngram=ngram,
                )
            )
    return out


def host_seconds(config: DecodeConfig, acceptance: Acceptance, lookup_seconds: float) -> float:
    kind = family(config)
    base = acceptance.ar_host_seconds if kind == "ar" else acceptance.steps_for(kind, config.block_size).host_seconds
    return base + (lookup_seconds if config.lookup_tokens else 0.0)


def lookup_host_seconds(acceptance: Acceptance) -> float:
    """The decoder's extra time per step for prompt lookup: the replay's own Python cost per forward."""
    start, forwards = time.perf_counter(), 0
    for prompt, output in zip(acceptance.prompts, acceptance.greedy):
        forwards += simulate(prompt, output, 3, 8).forwards
    return (time.perf_counter() - start) / max(forwards, 1)


def confirm(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    configs: Sequence[DecodeConfig],
    predicted: Sequence[float],
    eos: Sequence[int],
    pad: int,
    max_new_tokens: int,
    batch_size: int,
    rounds: int,
    log: Callable[[str], None] = print,
) -> list[Confirmed]:
    """Decode `prompts` (as batches of `batch_size` rows) with AR and every config, interleaved, `rounds` times;
    each config's speedup is the median over rounds of AR's seconds over its own. configs[0] must be AR."""
    sync = device_sync(next(model.parameters()).device)
    rows = [prompts[i % len(prompts)] for i in range(max(batch_size, len(prompts)))]
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    decoders = [Decoder(model, replace(c, max_new_tokens=max_new_tokens), eos, pad) for c in configs]
    for d in decoders:  # warm-up: one-off costs stay out of the timings
        d.decode([list(batches[0][0])])
    seconds = [[0.0] * rounds for _ in configs]
    tokens, forwards, outputs = [0] * len(configs), [0] * len(configs), [[] for _ in configs]
    for r in range(rounds):
        order = list(range(len(configs)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            for batch in batches:
                sync()
                start = time.perf_counter()
                out = decoders[i].decode([list(p) for p in batch])
                sync()
                seconds[i][r] += time.perf_counter() - start
                if r == 0:
                    tokens[i] += out.stats.new_tokens
                    forwards[i] += out.stats.decode_forwards
                    outputs[i] += out.sequences
        log(
            f"confirm round {r + 1}/{rounds}: "
            + ", ".join(f"{c.describe()} {seconds[i][r]:.1f}s" for i, c in enumerate(configs))
        )
    result = []
    for i, config in enumerate(configs):
        ratios = tuple(seconds[0][r] / seconds[i][r] for r in range(rounds))
        result.append(
            Confirmed(
                config,
                predicted[i],
                statistics.median(ratios),
                ratios,
                tokens[i] / max(forwards[i], 1),
                outputs[i] == outputs[0],
            )
        )
    return result


def run_tune(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    config: TuneConfig,
    eos: Sequence[int],
    pad: int,
    trained_block_size: int | None = None,
    log: Callable[[str], None] = print,
) -> TuneResult:
    """Tune `model` on the (already tokenised) tuning prompts."""
    start = time.perf_counter()
    budget = config.max_minutes * 60

    def over(share: float, what: str) -> bool:
        late = time.perf_counter() - start > share * budget
        if late:
            log(f"tuning: past {share:.0%} of max_minutes ({config.max_minutes}); skipping {what}")
        return late

    device = next(model.parameters()).device
    machine = this_machine(device, model.dtype)
    record_n = config.record_block_size or trained_block_size or 16
    log(f"tuning on {machine.cpu} ({machine.cores} cores, {machine.torch_threads} threads, {machine.dtype})")
    tokens, rows = config.max_new_tokens, config.batch_size
    acceptance = greedy_pass(model, prompts, eos, pad, tokens, rows, log=log)
    # Each family's own drafts, recorded once at the trained n; the optional ones only while time is left. A rolling
    # window is recorded at half that n too: predicted from the wider window's runs, a narrower one was under-rated
    # (1.66x predicted, 1.71x measured), and it is where the cost curve of a 2-core CPU stops being flat.
    half = max((n for n in config.block_sizes if n <= record_n // 2), default=1)
    rolling_half = config.rolling and 1 < half < record_n
    families = (
        ("jacobi", True, None, DecodeConfig(method="jacobi", block_size=record_n)),
        ("rolling", config.rolling, 0.25, DecodeConfig(method="jacobi", block_size=record_n, rolling=record_n > 1)),
        ("multiblock", config.multiblock, 0.3, DecodeConfig(method="multiblock", block_size=record_n, pool_size=4)),
        (f"rolling@{half}", rolling_half, 0.35, DecodeConfig(method="jacobi", block_size=half, rolling=True)),
    )
    for name, wanted, share, drafting in families:
        if record_n > 1 and wanted and (share is None or not over(share, name)):
            acceptance.drafts[name] = record_drafts(model, prompts, drafting, eos, pad, tokens, rows, log=log)
    lookup_s = lookup_host_seconds(acceptance)
    result = TuneResult(machine, acceptance)
    recorded = {name.split("@")[0] for name in acceptance.drafts}
    candidates = [c for c in grid(config, record_n) if family(c) in ("ar", *recorded)]
    # Confirmation decodes a few prompts spread over the split; their predictions are made on the same prompts.
    k = min(config.confirm_prompts, len(prompts))
    chosen_rows = sorted({round(i * len(prompts) / k) for i in range(k)})
    confirm_acceptance = acceptance.subset(chosen_rows)
    for b in sorted(set(config.batch_sizes)):
        if result.buckets and over(0.75, f"batch-size bucket {b}"):
            break
        curve = measure_curve(model, b, config.widths, rounds=config.curve_rounds)
        log(f"batch {b}: t(q)/t(1) " + " ".join(f"{w}:{curve.ratio(w):.2f}" for w in curve.widths))
        surface = sorted(
            (predict(c, acceptance, curve, host_seconds(c, acceptance, lookup_s)) for c in candidates),
            key=lambda p: -p.speedup,
        )
        ar = next(p for p in surface if p.config.method == "ar" and not p.config.lookup_tokens)
        best = [p for p in surface if p is not ar][: config.confirm]
        log(f"batch {b}: predicted " + ", ".join(f"{p.config.describe()} {p.speedup:.2f}x" for p in best))
        on_rows = [
            predict(p.config, confirm_acceptance, curve, host_seconds(p.config, acceptance, lookup_s)) for p in best
        ]
        confirmed = confirm(
            model,
            [prompts[i] for i in chosen_rows],
            [ar.config] + [p.config for p in best],
            [1.0] + [p.speedup for p in on_rows],
            eos,
            pad,
            config.max_new_tokens,
            b,
            config.rounds,
            log,
        )
        exact = [c for c in confirmed if c.exact]
        chosen = max(exact, key=lambda c: c.measured)
        log(f"batch {b}: chose {chosen.config.describe()}, measured {chosen.measured:.2f}x AR")
        result.buckets.append(BucketResult(b, curve, chosen, tuple(confirmed), tuple(surface)))
    result.seconds = time.perf_counter() - start
    return result
