"""The campaign report's seconds per stage count the runs that wrote the output it reports, not a rerun of the
same stage name with other settings, nor the stages of another recipe that shares its work_dir."""

from __future__ import annotations

import json

from bench.campaign_report import phase_figures
from flows.recipe import load_recipe
from jfcore.contracts import LATEST, TIMINGS, TRAINING


def test_a_rerun_with_other_settings_is_not_added_to_the_reported_runs_seconds(tmp_path):
    recipe = load_recipe(
        {
            "work_dir": str(tmp_path),
            "model": {"name_or_path": "m"},
            "curriculum": [{"name": "a", "block_size": 8}, {"name": "b", "block_size": 8}],
        }
    )
    runs = recipe.stages()[1].path(TRAINING)
    for key in ("old", "new"):
        (runs / key).mkdir(parents=True)
    (runs / LATEST).symlink_to("new")
    records = [
        {"stage": "training/b", "seconds": 600.0, "output": str(runs / "old")},  # the rerun's predecessor
        {"stage": "training/b", "seconds": 300.0, "output": str(runs / "new")},  # stopped, then resumed:
        {"stage": "training/b", "seconds": 40.0, "output": str(runs / "new")},  # both pieces count
        {"stage": "training/a", "seconds": 7.0},  # written before records named their output: counted
        {"stage": "training/a", "seconds": 5.0},
        {"stage": "training/c", "seconds": 900.0},  # another recipe's stage in the same work_dir
        {"stage": "packing/c", "seconds": 2.0},
        {"stage": "packing/b", "seconds": 3.0},
    ]
    recipe.path(TIMINGS).write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = phase_figures(recipe)
    assert figures["training/b"] == {"seconds": 340.0, "invocations": 2}
    assert figures["training/a"] == {"seconds": 12.0, "invocations": 2}
    assert figures["packing/b"] == {"seconds": 3.0, "invocations": 1}
    assert "training/c" not in figures and "packing/c" not in figures
