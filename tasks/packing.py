"""Packing: the trajectories a selection file names into noise-scheduled training sequences."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jfcore.config import from_dict
from jfcore.packing import PackingConfig, PackingError, pack_shards
from jfcore.shards import MANIFEST
from tasks.orchestration import get_run_logger, task

STATS = "stats.json"  # written last: a packed folder without it is unfinished


def pack_trajectories(trajectories: str | Path, out_dir: str | Path, config: PackingConfig) -> dict:
    """Pack a trajectory selection file (the trajectory stage's output) or a whole finished run folder;
    returns the packing statistics."""
    source = Path(trajectories)
    if source.is_file():  # a selection: these prompts of these shards of a store
        selection = json.loads(source.read_text())
        store = Path(selection["store"])
        files = {str(store / name): ids for name, ids in selection["shards"].items()}
        return pack_shards(list(files), out_dir, config, select=files).as_dict()
    manifest = source / MANIFEST
    if manifest.is_file() and not json.loads(manifest.read_text()).get("complete"):
        raise PackingError(
            f"{trajectories} is an unfinished trajectory run (its manifest is not marked complete); "
            "run trajectory generation again with the same settings to finish it"
        )
    return pack_shards([trajectories], out_dir, config).as_dict()


def packed_problem(folder: str | Path) -> str | None:
    """Why `folder` is not a complete packed set (None when it is): stats.json present, every shard it lists
    readable, and their rows adding up to its sequence count."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} is new"
    if not (folder / STATS).is_file():
        return f"{folder / STATS} is missing"
    stats = json.loads((folder / STATS).read_text())
    try:
        rows = sum(pq.read_metadata(folder / name).num_rows for name in stats["shards"])
    except (OSError, pa.ArrowException) as err:
        return f"a packed shard in {folder} is missing or unreadable ({err})"
    return (
        None if rows == stats["sequences"] else f"{folder} holds {rows} sequences, its stats say {stats['sequences']}"
    )


@task(name="pack-trajectories")
def pack_trajectories_task(trajectories: str, out_dir: str, packing: dict) -> dict:
    """Prefect task over `pack_trajectories`; the config is plain data, checked strictly."""
    stats = pack_trajectories(trajectories, out_dir, from_dict(PackingConfig, packing, "packing"))
    get_run_logger().info(
        "packed %d sequences, %d tokens; %.0f%% of blocks carry consistency loss",
        stats["sequences"],
        stats["tokens"],
        100 * stats["consistency_share"],
    )
    return stats
