"""Trajectory shards on disk: planning, atomic writes, and a manifest that makes runs resumable.

A run's output folder is named by a key over everything that determines its
content (model, tokenizer, prompts, decoding settings), so a changed input
never reuses stale shards. Inside it, each shard is written to a temporary
file and renamed into place, and `manifest.json` lists the shards that are
complete, with row counts and checksums. A rerun skips the shards in the
manifest whose files still match and redoes the rest: a crash loses at most
the shards in flight, and no row is ever written twice.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jfcore.atomic import atomic_write
from jfcore.contracts import MANIFEST


@dataclass(frozen=True)
class ShardSpec:
    """Prompts [start, stop) of the prompt set go into shard `index`."""

    index: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}.parquet"


@dataclass(frozen=True)
class ShardRecord:
    name: str
    rows: int
    prompts: int
    sha256: str
    keys: tuple[str, ...] = ()  # the prompt keys whose rows it holds (trajectory shards; see PromptSet.keys)


def plan_shards(num_prompts: int, prompts_per_shard: int, first_index: int = 0) -> list[ShardSpec]:
    """Shards of at most `prompts_per_shard` items, numbered from `first_index` (after a folder's existing ones)."""
    return [
        ShardSpec(first_index + i, start, min(start + prompts_per_shard, num_prompts))
        for i, start in enumerate(range(0, num_prompts, prompts_per_shard))
    ]


def run_key(**inputs: object) -> str:
    """A short digest of everything that determines a run's output."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_shard(
    table: pa.Table, folder: Path, spec: ShardSpec, prompts: int, keys: tuple[str, ...] = ()
) -> ShardRecord:
    """Write `table` as the shard `spec` atomically; return its record."""
    path = folder / spec.name
    atomic_write(path, functools.partial(pq.write_table, table, compression="zstd"))
    return ShardRecord(spec.name, table.num_rows, prompts, file_sha256(path), tuple(keys))


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        return {"shards": {}}
    return json.loads(path.read_text())


def write_manifest(folder: Path, manifest: dict) -> None:
    """Replace the manifest atomically: readers see the old or the new one, never half of it."""
    text = json.dumps(manifest, indent=1, sort_keys=True)
    atomic_write(folder / MANIFEST, lambda tmp: tmp.write_text(text))


def completed_shards(folder: Path, specs: list[ShardSpec]) -> dict[str, ShardRecord]:
    """Shards of `specs` the manifest lists and whose files still match their checksums."""
    verified = verified_shards(folder)
    return {spec.name: verified[spec.name] for spec in specs if spec.name in verified}


def verified_shards(folder: Path) -> dict[str, ShardRecord]:
    """Every shard the manifest lists whose file still matches its checksum."""
    listed = read_manifest(folder)["shards"]
    return {
        name: ShardRecord(**{**entry, "keys": tuple(entry.get("keys", ()))})
        for name, entry in listed.items()
        if (folder / name).is_file() and file_sha256(folder / name) == entry["sha256"]
    }


def drop_unverified(folder: Path) -> dict[str, ShardRecord]:
    """Forget (and delete) the listed shards whose files are gone or changed; returns the ones that verify."""
    verified = verified_shards(folder)
    manifest = read_manifest(folder)
    lost = [name for name in manifest["shards"] if name not in verified]
    if lost:
        for name in lost:
            (folder / name).unlink(missing_ok=True)
        manifest["shards"] = {k: v for k, v in manifest["shards"].items() if k in verified}
        write_manifest(folder, manifest)
    return verified


def record_shard(folder: Path, record: ShardRecord, settings: dict) -> None:
    """Add a finished shard to the manifest (the single writer is the driver process)."""
    manifest = read_manifest(folder)
    manifest["settings"] = settings
    manifest["shards"][record.name] = asdict(record)
    write_manifest(folder, manifest)


def remove_stale_temporaries(folder: Path) -> None:
    """Temporary files left by a crashed writer are garbage: the manifest never lists them."""
    for tmp in folder.glob(".shard-*.tmp"):
        tmp.unlink(missing_ok=True)
