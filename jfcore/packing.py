"""Packing Jacobi trajectories into training sequences (docs/DESIGN.md, sections 4 and 5).

One packed sequence per prompt: [prompt][k_0][l_0]...[k_{T-1}][l_{T-1}], where
l_j is block j's fixed point and k_j the state of block j's trajectory whose
noise level is nearest the schedule's target. k_j and l_j share position ids
P + j*n + t, so one forward with the noise-aware mask computes teacher (clean
stream) and student (noisy stream).

Every block is n long in the packed sequence: a prompt's last block may be
shorter (it ended at EOS or max_new_tokens), so its k and l copies are padded
with `pad_token_id`. The trainer must find padding through `valid_lengths`,
never through the PAD id, which may also be a real token. Noise levels of such
a block are taken over its valid length m, (m - d) / m, so t = 0 still selects
its fixed point.

A seeded hash of the prompt id keeps a share of whole prompts out of training
(`heldout_fraction`): they are packed alike into `heldout/`, where training
measures acceptance (jfcore/training/acceptance.py), and stats.json lists them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jfcore.atomic import atomic_write
from jfcore.config import check, to_dict
from jfcore.contracts import HELDOUT, PACKED_SCHEMA, STATS
from jfcore.evaluation.repetition import LOOP_PERIOD, short_loop_start
from jfcore.trajectories import first_mismatch

# The trajectory columns packing reads (jfcore.contracts.TRAJECTORY_SCHEMA).
REQUIRED_COLUMNS = (
    "prompt_id",
    "block_index",
    "block_size",
    "prompt_length",
    "context",
    "states",
    "fixed_point",
    "last_block",
    "tokenizer_fingerprint",
)
HISTOGRAM_BINS = 10
# Targets are floats and noise levels exact ratios: distances within this are ties.
TIE_TOLERANCE = 1e-9


class PackingError(ValueError):
    """The trajectory shards cannot be packed; the message names the file or prompt and why."""


@dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """How to choose each block's noisy state and shape the packed sequences."""

    strategy: Literal["progressive", "random"] = "progressive"
    window: int = 8  # w: the progressive ramp restarts every w blocks (a response of fewer blocks gets all of it)
    min_noise: float = 0.0
    max_noise: float = 1.0
    seed: int = 0  # for the random strategy
    max_length: int | None = None  # drop whole blocks from the end to fit; None: no cap
    pad_token_id: int = 0  # fills short last blocks; any valid token id (see module docstring)
    expected_tokenizer_fingerprint: str | None = None  # refuse shards made with another tokenizer
    sequences_per_shard: int = 4096
    heldout_fraction: float = 0.0  # share of prompts (by a seeded hash of their id) packed into heldout/, not trained
    heldout_seed: int = 0
    # Training sequences per prompt, each with its own choice of noisy states (sample s shifts the progressive ramp
    # by s blocks, or redraws the random targets). One state per block lets the consistency loss be met by answers
    # for that state alone; decoding visits others (docs/TRAINING.md, "What moves own-draft TPF"). Held-out
    # prompts get one.
    samples_per_prompt: int = 1
    # Pack an answer only up to the short loop it ends in (jfcore/evaluation/repetition.py), whole blocks before
    # the loop's first token. A trained model's own trajectories end in loops more often than the base model's,
    # and training on them teaches more loops: the on-policy round's loop endings went from 10% to 27.5% of its
    # answers (docs/TRAINING.md, "What moves own-draft TPF").
    cut_loops: bool = False
    # The longest loop period cut_loops looks for, in tokens: 2 finds newline and comma runs; 48 a repeated line or
    # sentence too, which the default leaves in (the third on-policy round's trajectories ended 24% of answers in one).
    loop_period: int = LOOP_PERIOD

    def __post_init__(self) -> None:
        check(self.strategy in ("progressive", "random"), f"unknown strategy {self.strategy!r}")
        check(self.window >= 1, f"window must be >= 1, got {self.window}")
        check(
            0.0 <= self.min_noise <= self.max_noise <= 1.0,
            f"need 0 <= min_noise <= max_noise <= 1, got min_noise={self.min_noise}, max_noise={self.max_noise}",
        )
        check(self.max_length is None or self.max_length >= 1, f"max_length must be >= 1, got {self.max_length}")
        check(self.pad_token_id >= 0, f"pad_token_id must be >= 0, got {self.pad_token_id}")
        check(self.sequences_per_shard >= 1, f"sequences_per_shard must be >= 1, got {self.sequences_per_shard}")
        check(0.0 <= self.heldout_fraction < 1.0, f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        check(self.samples_per_prompt >= 1, f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        check(self.loop_period >= 1, f"loop_period must be >= 1, got {self.loop_period}")


@dataclass
class PackingStats:
    sequences: int = 0
    tokens: int = 0  # packed tokens, padding included
    blocks: int = 0
    consistency_blocks: int = 0  # blocks with k_j != l_j: the only ones with consistency loss
    skipped: int = 0  # prompts whose first block alone exceeds max_length (answers that are all loop aside)
    dropped_blocks: int = 0  # blocks cut from the end of sequences to respect max_length
    loop_blocks: int = 0  # blocks cut from the end of answers that end in a short loop (cut_loops)
    noise_histogram: list[int] = field(default_factory=lambda: [0] * HISTOGRAM_BINS)  # equal bins over [0, 1]
    tokenizer_fingerprint: str | None = None
    shards: list[str] = field(default_factory=list)  # packed shard file names
    heldout_prompts: list[str] = field(default_factory=list)  # kept out of training, packed into heldout/

    @property
    def consistency_share(self) -> float:
        return self.consistency_blocks / self.blocks if self.blocks else 0.0

    def add(self, seq: dict) -> None:
        self.sequences += 1
        self.tokens += len(seq["input_ids"])
        self.blocks += seq["num_blocks"]
        for d, m in zip(seq["first_mismatch"], seq["valid_lengths"]):
            self.consistency_blocks += d < m
            self.noise_histogram[min((m - d) * HISTOGRAM_BINS // m, HISTOGRAM_BINS - 1)] += 1  # exact integer binning

    def as_dict(self) -> dict:
        edges = [i / HISTOGRAM_BINS for i in range(HISTOGRAM_BINS + 1)]
        return dataclasses.asdict(self) | {"consistency_share": self.consistency_share, "histogram_edges": edges}


def noise_level(first_mismatch: int, n: int) -> float:
    """(n - d) / n for a state whose first mismatch with the fixed point is d: 0 for the fixed point."""
    return (n - first_mismatch) / n


def block_target(config: PackingConfig, prompt_id: str, block_index: int, num_blocks: int, sample: int = 0) -> float:
    """The noise level the schedule asks for at block `block_index` of `prompt_id`, packed with `num_blocks` blocks,
    in the prompt's sequence number `sample` (samples_per_prompt).

    progressive: W = linspace(min_noise, max_noise, w) and target W[(block_index + sample) mod w], a ramp that
    restarts every w blocks, with w = min(window, num_blocks): a response of fewer blocks than the window gets the
    whole ramp over its own blocks. (A fixed w gave it only the ramp's quiet start: 4 blocks in a window of 8 never
    passed noise 3/7, and a synthetic task whose drafts can be learned exactly stayed at 1.2 tokens per forward;
    docs/DESIGN.md, section 4.)"""
    lo, hi = config.min_noise, config.max_noise
    if config.strategy == "random":
        key = (config.seed, prompt_id, block_index) + ((sample,) if sample else ())
        return lo + _unit_hash(*key) * (hi - lo)
    window = min(config.window, num_blocks)
    if window <= 1:
        return lo
    return float(np.linspace(lo, hi, window)[(block_index + sample) % window])


def is_heldout(config: PackingConfig, prompt_id: str) -> bool:
    """Whether a prompt is kept out of training: a seeded hash of its id, so the choice does not depend on the
    shards, their order or which other prompts are packed, and a prompt stays on its side as prompts are added."""
    return _unit_hash(config.heldout_seed, "heldout", prompt_id) < config.heldout_fraction


def _unit_hash(*key) -> float:
    """A hash of `key` as a float in [0, 1): independent draws without a running generator."""
    digest = hashlib.blake2b("\0".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def choose_state(mismatches: Sequence[int], length: int, target: float) -> int:
    """Index of the state whose noise level is nearest `target`; ties go to the noisier, earlier state."""
    noise = [noise_level(d, length) for d in mismatches]
    best = min(abs(x - target) for x in noise)
    tied = [i for i, x in enumerate(noise) if abs(x - target) <= best + TIE_TOLERANCE]
    return max(tied, key=lambda i: (noise[i], -i))


def pack_prompt(prompt_id: str, rows: list[dict], config: PackingConfig, sample: int = 0) -> dict | None:
    """The packed sequence of one prompt from all its trajectory rows (None: too long for max_length); `sample`
    numbers the prompt's sequences (samples_per_prompt)."""
    rows = sorted(rows, key=lambda r: r["block_index"])
    if problem := _prompt_problem(rows):
        raise PackingError(f"prompt {prompt_id!r}: {problem} (the trajectory shards are inconsistent)")
    n, P = rows[0]["block_size"], rows[0]["prompt_length"]
    T = len(rows) if config.max_length is None else min(len(rows), (config.max_length - P) // (2 * n))
    T = min(T, loop_free_blocks(rows, config.loop_period)) if config.cut_loops else T
    if T <= 0:
        return None
    seq = {
        "prompt_id": prompt_id,
        "input_ids": rows[0]["context"][:P],
        "position_ids": list(range(P)),
        "prompt_length": P,
        "block_size": n,
        "num_blocks": T,
        "first_mismatch": [],
        "noise_levels": [],
        "valid_lengths": [],
    }
    for j, row in enumerate(rows[:T]):
        fixed, m = row["fixed_point"], len(row["fixed_point"])
        mismatches = [first_mismatch(s, fixed) for s in row["states"]]
        chosen = choose_state(mismatches, m, block_target(config, prompt_id, j, T, sample))
        pad = [config.pad_token_id] * (n - m)
        seq["input_ids"] += row["states"][chosen] + pad + fixed + pad
        seq["position_ids"] += list(range(P + j * n, P + (j + 1) * n)) * 2
        seq["first_mismatch"].append(mismatches[chosen])
        seq["noise_levels"].append(noise_level(mismatches[chosen], m))
        seq["valid_lengths"].append(m)
    return seq


def loop_free_blocks(rows: list[dict], period: int = LOOP_PERIOD) -> int:
    """How many of an answer's blocks (in order) end before the loop (of a period up to `period`) the answer ends
    in: all of them when it ends in none."""
    answer = [token for row in rows for token in row["fixed_point"]]
    start = short_loop_start(answer, period)
    return len(rows) if start is None else start // rows[0]["block_size"]


def _prompt_problem(rows: list[dict]) -> str | None:
    """Why the rows of one prompt do not tile its response, or None when they do."""
    indices = [r["block_index"] for r in rows]
    if indices != list(range(len(rows))):
        return f"block indices {indices} are not 0..{len(rows) - 1} (a block is missing or duplicated)"
    if [r["last_block"] for r in rows] != [False] * (len(rows) - 1) + [True]:
        return "only the final block, and always it, must be marked last_block (a shard is missing?)"
    n, P = rows[0]["block_size"], rows[0]["prompt_length"]
    text = rows[0]["context"][:P]
    for j, row in enumerate(rows):
        fixed, states = row["fixed_point"], row["states"]
        if (row["block_size"], row["prompt_length"]) != (n, P):
            return f"block {j} has another block size or prompt length than block 0"
        if row["context"] != text:
            return f"block {j}'s context is not the prompt followed by the fixed points of blocks < {j}"
        if not (len(fixed) == n or (j == len(rows) - 1 and 1 <= len(fixed) < n)):
            return f"block {j} has {len(fixed)} tokens; only the last block may be shorter than n={n}"
        if not states or states[-1] != fixed or any(len(s) != len(fixed) for s in states):
            return f"block {j}'s states must be {len(fixed)} tokens each and end at the fixed point"
        text = text + fixed
    return None


def pack_shards(
    paths: Sequence[str | Path],
    out_dir: str | Path,
    config: PackingConfig,
    select: Mapping[str, Collection[str]] | None = None,
) -> PackingStats:
    """Pack trajectory shards (files, or folders of *.parquet) into packed shards + stats.json in `out_dir`.

    `select`: file path -> the prompt ids to take from it (a store's shards may hold other prompts too).

    Memory stays bounded whatever the data set's size: a prompt's blocks may sit in any shard, so rows are
    first spilled into buckets of consecutive prompt ids (in sorted order), then each bucket is grouped,
    packed and streamed into the output shards. Only the distinct prompt ids are held for the whole run.
    The output is the same as grouping everything in memory: prompts in sorted order, shards cut every
    `sequences_per_shard` sequences."""
    files = _expand(paths)
    sources = [_open_shard(f) for f in files]
    wanted = None if select is None else [pa.array(sorted(select[str(f)]), pa.string()) for f in files]
    summaries = [_summary(f, source, keep) for f, source, keep in zip(files, sources, wanted or [None] * len(files))]
    stats = PackingStats(tokenizer_fingerprint=_check_shards(files, summaries, config))
    prompt_ids = pc.unique(pa.chunked_array([s.prompt_ids for s in summaries], pa.string()))
    prompt_ids = prompt_ids.take(pc.sort_indices(prompt_ids))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / STATS).unlink(missing_ok=True)  # an old marker must not vouch for a half-rewritten set
    shutil.rmtree(out_dir / HELDOUT, ignore_errors=True)
    (out_dir / HELDOUT).mkdir()
    for stale in out_dir.glob(".spill-*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    heldout = PackingStats(tokenizer_fingerprint=stats.tokenizer_fingerprint)
    writers = {False: _ShardWriter(out_dir, config, stats), True: _ShardWriter(out_dir / HELDOUT, config, heldout)}
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".spill-") as spill:
        for bucket in _spill_by_prompt(files, sources, wanted, prompt_ids, Path(spill)):
            by_prompt: dict[str, list[dict]] = defaultdict(list)
            for row in bucket.to_pylist():
                by_prompt[row["prompt_id"]].append(row)
            del bucket
            for prompt_id in sorted(by_prompt):
                held = is_heldout(config, prompt_id)
                rows = sorted(by_prompt[prompt_id], key=lambda r: r["block_index"])
                seq = pack_prompt(prompt_id, rows, config)  # checks the rows first
                looped = len(rows) - loop_free_blocks(rows, config.loop_period) if config.cut_loops else 0
                (heldout if held else stats).loop_blocks += looped
                if seq is None:
                    stats.skipped += looped < len(rows)  # an answer that is all loop is not "too long"
                    continue
                if held:
                    stats.heldout_prompts.append(prompt_id)
                    heldout.add(seq)
                    writers[True].add(seq)
                    continue
                for sample in range(config.samples_per_prompt):
                    seq = seq if sample == 0 else pack_prompt(prompt_id, rows, config, sample)
                    stats.dropped_blocks += len(rows) - looped - seq["num_blocks"]
                    stats.add(seq)
                    writers[False].add(seq)
    if not stats.sequences:
        if stats.heldout_prompts:
            raise PackingError(
                f"every packed prompt ({len(stats.heldout_prompts)}) is held out: lower heldout_fraction "
                f"({config.heldout_fraction}) or pack more prompts"
            )
        raise PackingError(f"no prompt fits max_length={config.max_length} (all {stats.skipped} skipped)")
    if heldout.sequences:
        writers[True].close()
    else:
        (out_dir / HELDOUT).rmdir()
    writers[False].close()
    return stats


# Prompts per spill bucket: a bucket's rows are grouped in memory, so this bounds packing's memory.
PROMPTS_PER_BUCKET = 1024
MAX_BUCKETS = 256  # open spill files at once; larger data sets get larger buckets
SPILL_BATCH_ROWS = 256


@dataclass(frozen=True)
class _ShardSummary:
    rows: int
    prompt_ids: pa.Array  # distinct
    block_sizes: list[int]
    fingerprints: list[str]


def _summary(path: Path, source: pq.ParquetFile, keep: pa.Array | None) -> _ShardSummary:
    """What the checks need from one shard, read from its small columns only."""
    try:
        table = source.read(columns=["prompt_id", "block_size", "tokenizer_fingerprint"])
    except (pa.ArrowException, OSError) as err:
        raise _unreadable(path, err) from err
    if keep is not None:
        table = table.filter(pc.is_in(table["prompt_id"], value_set=keep))
    return _ShardSummary(
        table.num_rows,
        pc.unique(table["prompt_id"]),
        pc.unique(table["block_size"]).to_pylist(),
        pc.unique(table["tokenizer_fingerprint"]).to_pylist(),
    )


def _spill_by_prompt(
    files: list[Path],
    sources: list[pq.ParquetFile],
    wanted: list[pa.Array] | None,
    prompt_ids: pa.Array,
    folder: Path,
) -> Iterator[pa.Table]:
    """Every selected row, bucketed by its prompt's rank among the sorted `prompt_ids`: yields the buckets
    (Arrow tables, memory-mapped from spill files) in prompt-id order."""
    per_bucket = max(PROMPTS_PER_BUCKET, -(-len(prompt_ids) // MAX_BUCKETS))
    writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
    try:
        for i, (path, source) in enumerate(zip(files, sources)):
            try:
                for batch in source.iter_batches(batch_size=SPILL_BATCH_ROWS, columns=list(REQUIRED_COLUMNS)):
                    if wanted is not None:
                        batch = batch.filter(pc.is_in(batch["prompt_id"], value_set=wanted[i]))
                    bucket = pc.divide(pc.index_in(batch["prompt_id"], value_set=prompt_ids), per_bucket)
                    for b in pc.unique(bucket).to_pylist():
                        if b not in writers:
                            writers[b] = pa.ipc.new_file(folder / f"bucket-{b:05d}.arrow", batch.schema)
                        writers[b].write_batch(batch.filter(pc.equal(bucket, b)))
            except (pa.ArrowException, OSError) as err:
                raise _unreadable(path, err) from err
    finally:
        for writer in writers.values():
            writer.close()
    for b in sorted(writers):
        with pa.memory_map(str(folder / f"bucket-{b:05d}.arrow")) as source:
            yield pa.ipc.open_file(source).read_all()


class _ShardWriter:
    """Packed sequences streamed into packed-NNNNN.parquet files of `sequences_per_shard` rows each; stale
    shards of an earlier, larger run removed; stats.json written last, marking a complete set."""

    CHUNK = 256  # sequences turned into one Arrow batch at a time

    def __init__(self, out_dir: Path, config: PackingConfig, stats: PackingStats):
        self.out_dir, self.config, self.stats = out_dir, config, stats
        self.pending: list[dict] = []
        self.batches: list[pa.RecordBatch] = []
        self.in_shard = 0

    def add(self, seq: dict) -> None:
        self.pending.append(seq)
        self.in_shard += 1
        if len(self.pending) == self.CHUNK:
            self._flush()
        if self.in_shard == self.config.sequences_per_shard:
            self._write_shard()

    def _flush(self) -> None:
        if self.pending:
            self.batches.append(pa.RecordBatch.from_pylist(self.pending, schema=PACKED_SCHEMA))
            self.pending = []

    def _write_shard(self) -> None:
        self._flush()
        path = self.out_dir / f"packed-{len(self.stats.shards):05d}.parquet"
        table = pa.Table.from_batches(self.batches, schema=PACKED_SCHEMA)
        atomic_write(path, functools.partial(pq.write_table, table, compression="zstd"))
        self.stats.shards.append(path.name)
        self.batches, self.in_shard = [], 0

    def close(self) -> None:
        if self.in_shard:
            self._write_shard()
        for stale in self.out_dir.glob("packed-*.parquet"):  # left by an earlier run with more shards
            if stale.name not in self.stats.shards:
                stale.unlink()
        text = json.dumps(self.stats.as_dict() | {"config": to_dict(self.config)}, indent=2)
        atomic_write(self.out_dir / STATS, lambda tmp: tmp.write_text(text))


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(path.glob("*.parquet"))
        elif path.is_file():
            files.append(path)
        else:
            raise PackingError(f"trajectory shard not found: {path}")
    if not files:
        raise PackingError(f"no trajectory shards to pack (given: {[str(p) for p in paths]})")
    return files


def _open_shard(path: Path) -> pq.ParquetFile:
    try:
        source = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise _unreadable(path, err) from err
    missing = [c for c in REQUIRED_COLUMNS if c not in source.schema_arrow.names]
    if missing:
        raise PackingError(
            f"{path}: not a trajectory shard: missing column(s) {', '.join(missing)} "
            "(expected the schema of jfcore.trajectories.TRAJECTORY_SCHEMA)"
        )
    return source


def _unreadable(path: Path, err: Exception) -> PackingError:
    return PackingError(f"{path}: cannot read this Parquet file (corrupt or truncated?): {err}")


def _check_shards(files: list[Path], summaries: list[_ShardSummary], config: PackingConfig) -> str:
    """Refuse empty input, mixed block sizes and foreign tokenizers; return the tokenizer fingerprint."""
    if sum(s.rows for s in summaries) == 0:
        raise PackingError(f"the trajectory shards hold no rows: {', '.join(map(str, files))}")
    sizes: dict[int, Path] = {}  # value -> the first file that has it
    tokenizers: dict[str, Path] = {}
    expected = config.expected_tokenizer_fingerprint
    for path, summary in zip(files, summaries):
        for n in summary.block_sizes:
            sizes.setdefault(n, path)
        for fp in summary.fingerprints:
            tokenizers.setdefault(fp, path)
            if expected is not None and fp != expected:
                raise PackingError(
                    f"{path}: made with tokenizer fingerprint {fp!r}, but the configured tokenizer has {expected!r}; "
                    "regenerate the trajectories with this tokenizer, or point the recipe at the model that made them"
                )
    if len(sizes) > 1:
        (a, fa), (b, fb) = list(sizes.items())[:2]
        raise PackingError(f"mixed block sizes: n={a} in {fa} but n={b} in {fb}; pack one block size at a time")
    if len(tokenizers) > 1:
        (a, fa), (b, fb) = list(tokenizers.items())[:2]
        raise PackingError(f"mixed tokenizers: fingerprint {a!r} in {fa} but {b!r} in {fb}")
    return next(iter(tokenizers))
