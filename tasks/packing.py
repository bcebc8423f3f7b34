"""The packing stage: the trajectories a selection file names into noise-scheduled training sequences.

Its folder is `packing/<digest of the selected shards and the packing settings>`, reused while its
files verify (stats.json present and every shard it lists readable, with the rows it says).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jfcore.config import ConfigError
from jfcore.contracts import MANIFEST, PACKING, STATS, Selection
from jfcore.evaluation.repetition import LOOP_PERIOD
from jfcore.packing import PackingConfig, PackingError, pack_shards
from jfcore.shards import run_key
from tasks.orchestration import get_run_logger, task
from tasks.plan import StagePlan
from tasks.tracking import DataInput, TrackingConfig, record_stage


@dataclass(frozen=True)
class PackingResult:
    folder: str  # the packed shards and stats.json: the training stage's data
    stats: dict  # stats.json: sequences, tokens, the noise-level histogram, ...
    reused: bool  # an earlier run had packed the same trajectories with the same settings


def pack_trajectories(trajectories: str | Path, out_dir: str | Path, config: PackingConfig) -> dict:
    """Pack a trajectory selection file (the trajectories stage's output) or a whole finished run folder;
    returns the packing statistics."""
    source = Path(trajectories)
    if source.is_file():  # a selection: these prompts of these shards of a store
        files = Selection.read(source).files()
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


def packing_identity(packing: PackingConfig) -> dict:
    """The packing settings a packed folder's key holds: `cut_loops` only when on and `loop_period` only when it
    cuts other loops than the default, the keys packed folders had before these existed (so they, and the training
    runs on them, are reused)."""
    settings = asdict(packing)
    if not packing.cut_loops or packing.loop_period == LOOP_PERIOD:
        del settings["loop_period"]
    if not packing.cut_loops:
        del settings["cut_loops"]
    return settings


def packing_stage(
    plan: StagePlan, selection: str, run: bool = True, log: Callable[[str], None] = print
) -> PackingResult:
    """Pack the selection into its folder unless a verified one exists; skipped (`run` false), it must."""
    chosen = Selection.read(selection)
    folder = plan.path(PACKING) / run_key(
        store=chosen.store, shards=chosen.shards, packing=packing_identity(plan.packing)
    )
    problem = packed_problem(folder)
    if problem is None:
        log(f"packing: reused {folder} (complete; its files verify)")
    elif run:
        log(f"packing: {problem}; packing")
        stats = pack_trajectories(selection, folder, plan.packing)
        log(
            f"packed {stats['sequences']} sequences, {stats['tokens']} tokens; "
            f"{100 * stats['consistency_share']:.0f}% of blocks carry consistency loss"
        )
    else:
        raise ConfigError(f"stage 'packing' skipped, but {problem}; include 'packing'")
    return PackingResult(str(folder), json.loads((folder / STATS).read_text()), reused=problem is None)


def selection_input(selection: str | Path) -> DataInput:
    """The trajectory rows a selection names, as the dataset packing reads: the store, a digest of which shard holds
    which prompt, and the rows of those shards."""
    chosen = Selection.read(selection)
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in chosen.files())
    return DataInput("trajectories", chosen.store, run_key(shards=chosen.shards), rows, "trajectories")


@task(name=PACKING)
def packing_task(plan: StagePlan, selection: str, tracking: TrackingConfig, run: bool = True) -> PackingResult:
    """The stage in a flow, recorded in MLflow (settings, figures, stats.json) when it runs."""
    result = packing_stage(plan, selection, run, get_run_logger().info)
    if run and tracking.uri:
        figures = {k: v for k, v in result.stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        params = {"packing": asdict(plan.packing), "trajectories": selection, "folder": result.folder}
        trajectories = [selection_input(selection)]
        record_stage(
            tracking, plan.run_name(PACKING), PACKING, params, figures, [Path(result.folder) / STATS], trajectories
        )
    return result
