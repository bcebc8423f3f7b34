"""A model's jacobi_forcing.json: what it was trained at, and the decoding tuned for it, per machine.

The one reader and writer of that file. Training writes `training`, `steps`
and `block_size` when it exports; the tuner adds `tuned`: the machine it
measured on and, per batch-size bucket, the chosen decoding settings with
their predicted and measured speedups. Every consumer (jf-serve, jf-decode,
the MLflow pyfunc, evaluation, the registry gate) starts from
`decoding_for`: the tuned settings when this machine is the tuned one, the
untuned default otherwise (said in one log line), then its explicit settings
on top.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jfcore.atomic import atomic_write
from jfcore.config import ConfigError, check, from_dict
from jfcore.contracts import EXPORT_METADATA
from jfcore.decoding import DecodeConfig
from jfcore.machine import EngineIdentity, MachineIdentity, this_engine

DEFAULT_BLOCK_SIZE = 16  # a model with no training record of its own
# The decoding keys a tune chooses and stores; the rest of DecodeConfig (budget, seed, filler) is the caller's.
TUNED_KEYS = (
    "method",
    "block_size",
    "num_blocks",
    "spawn_ratio",
    "pool_size",
    "ngram_size",
    "lookup_tokens",
    "lookup_ngram",
    "lookup_within",
    "rolling",
)


def tuned_keys(config: DecodeConfig) -> dict:
    return {k: getattr(config, k) for k in TUNED_KEYS}


@dataclass(frozen=True)
class TunedBucket:
    batch_size: int  # decodes batches of up to this many rows (the largest bucket takes any larger batch)
    decoding: DecodeConfig  # only TUNED_KEYS are stored
    predicted_speedup: float  # over AR, on this machine
    measured_speedup: float  # over AR, confirmed by decoding

    def __post_init__(self) -> None:
        check(self.batch_size >= 1, f"batch_size: must be >= 1, got {self.batch_size}")


@dataclass(frozen=True, kw_only=True)
class TunedDecoding:
    machine: MachineIdentity
    buckets: tuple[TunedBucket, ...]
    engine: EngineIdentity | None = None  # the decoder code and kernel settings measured (None: an older tune)
    date: str = ""
    report: str = ""  # where the tuner wrote its full record (curve, surface, confirmed points)

    def __post_init__(self) -> None:
        sizes = [b.batch_size for b in self.buckets]
        check(bool(sizes), "buckets: a tune has at least one batch-size bucket")
        check(sizes == sorted(set(sizes)), f"buckets: batch sizes must ascend without repeats, got {sizes}")

    def bucket(self, batch_size: int) -> TunedBucket:
        """The smallest bucket that holds `batch_size` rows, else the largest."""
        return next((b for b in self.buckets if b.batch_size >= batch_size), self.buckets[-1])


def _path(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / EXPORT_METADATA


def read_metadata(checkpoint: str | Path) -> dict[str, Any]:
    """The whole file as plain data ({} when the model has none)."""
    path = _path(checkpoint)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); restore it or delete its 'tuned' section") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def trained_block_size(checkpoint: str | Path) -> int | None:
    """The block size the model was trained at (None: not trained by this project)."""
    return read_metadata(checkpoint).get("block_size")


def tuned_decoding(checkpoint: str | Path) -> TunedDecoding | None:
    """The model's tune, checked strictly: an unknown key is an error that names it."""
    return _tuned(read_metadata(checkpoint), checkpoint)


def _tuned(data: dict[str, Any], checkpoint: str | Path) -> TunedDecoding | None:
    tuned = data.get("tuned")
    return None if tuned is None else from_dict(TunedDecoding, tuned, f"{_path(checkpoint)}: tuned")


def write_tuned(checkpoint: str | Path, tuned: TunedDecoding) -> None:
    """Store `tuned` in the model's file, keeping what training wrote (replaces an earlier tune)."""
    data = read_metadata(checkpoint)
    plain = asdict(tuned)
    plain["buckets"] = [
        {**asdict(b), "decoding": tuned_keys(b.decoding)} for b in tuned.buckets
    ]  # settings the tune did not choose (budget, seed) stay the caller's
    data["tuned"] = plain
    atomic_write(_path(checkpoint), lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def decoding_for(
    checkpoint: str | Path | None,
    machine: MachineIdentity | None,
    batch_size: int = 1,
    explicit: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> DecodeConfig:
    """The decoding configuration to use for `checkpoint` on `machine` at `batch_size` rows.

    The model's tune for this machine and batch size, where it was measured by this decoder under the linear and
    compile settings asked for; else (one log line says why) the untuned default: Jacobi at the block size the model
    was trained at (16 for other models). `explicit` DecodeConfig keys override either; an explicit method other
    than the tune's starts from the untuned default.
    """
    explicit = dict(explicit or {})
    values: dict[str, Any] = {"block_size": DEFAULT_BLOCK_SIZE}
    if checkpoint is not None:
        data = read_metadata(checkpoint)
        values["block_size"] = data.get("block_size") or DEFAULT_BLOCK_SIZE
        tuned = _tuned(data, checkpoint)
        if tuned is None:
            log(f"decoding: {checkpoint} has no tune (run jf-tune on it); using the untuned default")
        elif machine is None or (differences := tuned.machine.differences(machine)):
            why = "no machine given" if machine is None else "; ".join(differences)
            log(f"decoding: the model was tuned on another machine ({why}); using the untuned default")
        elif stale := stale_engine(tuned, from_dict(DecodeConfig, {**values, **explicit}, "decoding")):
            log(f"decoding: the model's tune is stale ({stale}); using the untuned default (run jf-tune again)")
        elif explicit.get("method", (chosen := tuned.bucket(batch_size).decoding).method) == chosen.method:
            values = {**values, **tuned_keys(chosen)}
        # else another method was asked for: the tune's settings belong to its own method and do not carry over
    return from_dict(DecodeConfig, {**values, **explicit}, "decoding")


def stale_engine(tuned: TunedDecoding, config: DecodeConfig) -> str:
    """Why `tuned` does not hold for decoding with `config` here ('' when it does): it was measured by other decoder
    code, or under other linear or compile settings."""
    if tuned.engine is None:
        return "it records no decoder identity: made before tunes did"
    return "; ".join(tuned.engine.differences(this_engine(config)))
