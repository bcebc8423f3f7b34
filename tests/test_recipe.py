"""The pipeline recipe: the shipped ones load, and a malformed one fails before any stage, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.recipe import load_recipe
from jfcore.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
GOOD = {"work_dir": "runs/x", "model": {"name_or_path": "smollm2-135m-instruct"}}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("pipeline_*.yaml")))
def test_shipped_recipes_load(name):
    recipe = load_recipe(REPO / "configs" / name)
    assert recipe.train_config("packed").data == "packed"
    assert set(recipe.eval_config("final").models) == {"base", "trained"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"trajectories": {}}, "recipe: unknown key 'trajectories' (did you mean 'trajectory'?)"),
        ({"trajectory": {"block_size": -4}}, "recipe.trajectory: block_size must be >= 2"),
        ({"trajectory": {"block_size": "16"}}, "recipe.trajectory.block_size: expected an integer, got '16'"),
        ({"train": {"learning_rat": 1e-5}}, "train: unknown key 'learning_rat' (did you mean 'learning_rate'?)"),
        ({"train": {"output_dir": "x"}}, "train.output_dir: set by the flow"),
        ({"train": {"epochs": 0}}, "TrainConfig.epochs: must be >= 1"),
        ({"evaluation": {"benchmarks": [{"name": "gsm9k"}]}}, "recipe.evaluation.benchmarks[0].name: 'gsm9k' is not one"),
        ({"gate": {"method": "hf_greedy"}}, "gate.method: 'hf_greedy' is not jacobi or multiblock"),
        ({"schedule": {"cron": "every sunday"}}, "schedule.cron: 'every sunday' is not a 5-field cron expression"),
        ({"launch": {"processes": 0}}, "LaunchConfig.processes: must be >= 1"),
    ],
)
def test_malformed_recipes_name_the_key(change, message):
    with pytest.raises(ConfigError) as err:
        load_recipe(GOOD | change)
    assert message in str(err.value)


def test_work_dir_is_required():
    with pytest.raises(ConfigError, match="work_dir is required"):
        load_recipe({"model": {"name_or_path": "m"}})


def test_the_flow_refuses_a_missing_model_before_any_stage(tmp_path):
    from flows.jacobi_forcing import jacobi_forcing

    recipe = {"work_dir": str(tmp_path / "work"), "model": {"name_or_path": str(tmp_path / "no-such-model")}}
    with pytest.raises(ConfigError, match=r"recipe model.name_or_path: model path '.*no-such-model' does not exist"):
        jacobi_forcing(recipe)
    assert not (tmp_path / "work").exists()  # no stage wrote anything
    with pytest.raises(ConfigError, match=r"stages: unknown \['trian'\]"):
        jacobi_forcing(GOOD | {"work_dir": str(tmp_path / "w2")}, stages=["trian"])
