"""Packing: trajectory shards into noise-scheduled training sequences."""

from __future__ import annotations

import json
from pathlib import Path

from jfcore.config import from_dict
from jfcore.packing import PackingConfig, PackingError, pack_shards
from jfcore.shards import MANIFEST
from tasks.orchestration import get_run_logger, task


def pack_trajectories(trajectories: str | Path, out_dir: str | Path, config: PackingConfig) -> dict:
    """Pack a finished trajectory run folder; returns the packing statistics."""
    manifest = Path(trajectories) / MANIFEST
    if manifest.is_file() and not json.loads(manifest.read_text()).get("complete"):
        raise PackingError(
            f"{trajectories} is an unfinished trajectory run (its manifest is not marked complete); "
            "run trajectory generation again with the same settings to finish it"
        )
    return pack_shards([trajectories], out_dir, config).as_dict()


@task(name="pack-trajectories")
def pack_trajectories_task(trajectories: str, out_dir: str, packing: dict) -> dict:
    """Prefect task over `pack_trajectories`; the config is plain data, checked strictly."""
    stats = pack_trajectories(trajectories, out_dir, from_dict(PackingConfig, packing, "packing"))
    get_run_logger().info(
        "packed %d sequences, %d tokens; %.0f%% of blocks carry consistency loss",
        stats["sequences"], stats["tokens"], 100 * stats["consistency_share"],
    )
    return stats
