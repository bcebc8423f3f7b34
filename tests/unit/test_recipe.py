"""The pipeline recipe: the shipped ones load, and a malformed one fails before any stage, naming the key."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest

from flows.recipe import STAGES, load_recipe
from jfcore.config import ConfigError
from tests.support import REPO

GOOD = {"work_dir": "runs/x", "model": {"name_or_path": "smollm2-135m-instruct"}}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("pipeline_*.yaml")))
def test_shipped_recipes_load(name):
    recipe = load_recipe(REPO / "configs" / name)
    last = recipe.stages()[-1]
    assert last.training.output_dir == str(last.path("training")) and last.training.model.dtype == "float32"
    assert set(recipe.eval_config("final").models) == {"base", "trained"}
    if "7b_gpu" in name:  # the official curriculum: n = 16, then n = 32 from its model, window 16 throughout
        assert [(s.trajectories.block_size, s.packing.window) for s in recipe.stages()] == [(16, 16), (32, 16)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"trajectorie": {}}, "recipe: unknown key 'trajectorie' (did you mean 'trajectories'?)"),
        ({"evaluation": {"fp32_check": -1}}, "evaluation.fp32_check: must be >= 0"),
        (
            {"evaluation": {"learning_curve": {"max_new_tokens": 8}}},
            "recipe.evaluation.learning_curve: missing required key(s): benchmarks",
        ),
        ({"trajectories": {"block_size": -4}}, "recipe.trajectories: block_size must be >= 2"),
        ({"trajectories": {"block_size": "16"}}, "recipe.trajectories.block_size: expected an integer, got '16'"),
        ({"training": {"learning_rat": 1e-5}}, "training: unknown key 'learning_rat' (did you mean 'learning_rate'?)"),
        ({"training": {"output_dir": "x"}}, "training.output_dir: set by the flow"),
        ({"training": {"epochs": 0}}, "TrainConfig.epochs: must be >= 1"),
        ({"train": {"epochs": 2}}, "recipe: the section 'train' is now called 'training'; rename it"),
        ({"gate": {}}, "recipe: the section 'gate' is now called 'registry'; rename it"),
        (
            {"evaluation": {"benchmarks": [{"name": "gsm9k"}]}},
            "recipe.evaluation.benchmarks[0].name: 'gsm9k' is not one",
        ),
        ({"registry": {"method": "hf_greedy"}}, "gate.method: 'hf_greedy' is not tuned, jacobi or multiblock"),
        (
            {"evaluation": {"decoding": {"methods": ["hf_greedy", "jacobi"]}}},
            "registry.method: 'tuned' is not evaluated; add it to evaluation.decoding.methods",
        ),
        ({"tuning": {"rounds": 1}}, "recipe.tuning: rounds: the median needs >= 3 rounds"),
        (
            {"tuning": {"split": [{"path": "x.jsonl", "ask": "essay"}]}},
            "recipe.tuning.split[0].ask: 'essay' is not one",
        ),
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
    with pytest.raises(ConfigError, match=r"stages: unknown \['train'\].*; 'train' is now 'training'"):
        jacobi_forcing(GOOD | {"work_dir": str(tmp_path / "w2")}, stages=["train"])
    with pytest.raises(ConfigError, match=r"unknown key 'trajectroy' \(did you mean 'trajectories'\?\)"):
        jacobi_forcing(GOOD | {"work_dir": str(tmp_path / "w3"), "trajectroy": {}})  # not dropped by a schema


def test_the_flow_parameters_are_typed_so_the_ui_draws_a_form():
    from flows.jacobi_forcing import jacobi_forcing

    schema = jacobi_forcing.parameters.model_dump()
    recipe = schema["properties"]["recipe"]
    assert recipe["anyOf"] == [{"$ref": "#/definitions/Recipe"}, {"type": "string"}]
    sections = schema["definitions"]["Recipe"]["properties"]
    assert {"work_dir", "model", "prompts", "trajectories", "packing", "training", "evaluation", "registry"} <= set(
        sections
    )
    block_size = schema["definitions"]["TrajectoryConfig"]["properties"]["block_size"]
    assert block_size["type"] == "integer" and block_size["default"] == 16
    assert schema["properties"]["stages"]["anyOf"][0]["items"]["enum"] == list(STAGES)


def test_a_curriculum_chains_its_stages():
    recipe = load_recipe(
        GOOD
        | {
            "trajectories": {"max_new_tokens": 64},
            "packing": {"window": 8},
            "training": {"learning_rate": 1e-5, "epochs": 2},
            "curriculum": [
                {"name": "n16", "block_size": 16, "window": 16, "prompts": {"path": "code.jsonl", "field": "text"}},
                {"name": "n32", "block_size": 32, "prompts_limit": 10, "training": {"learning_rate": 5e-6}},
            ],
        }
    )
    first, second = recipe.stages()
    anchored = load_recipe(
        GOOD | {"curriculum": [{"name": "a", "block_size": 8}, {"name": "b", "block_size": 8, "anchor": "a"}]}
    )
    assert [plan.anchor for plan in anchored.stages()] == [None, "a"]
    assert (first.anchor, second.anchor) == (None, None)
    looped = load_recipe(GOOD | {"curriculum": [{"name": "a", "block_size": 8, "cut_loops": True, "loop_period": 48}]})
    assert (looped.stages()[0].packing.cut_loops, looped.stages()[0].packing.loop_period) == (True, 48)
    assert (first.packing.cut_loops, first.packing.loop_period) == (False, 2)  # the recipe's
    # a stage's own prompt source changes only the keys it names, and only for that stage
    assert (first.prompts.path, first.prompts.field) == ("code.jsonl", "text")
    assert second.prompts == replace(recipe.prompts, limit=10)
    root = Path("runs/x").resolve()
    assert (first.folder, second.folder) == (root / "n16", root / "n32")
    assert first.model.name_or_path == "smollm2-135m-instruct"
    assert second.model.name_or_path == str(root / "n16" / "training" / "latest" / "final")
    assert second.model.gguf_file is None
    assert (first.trajectories.block_size, second.trajectories.block_size) == (16, 32)
    assert (first.packing.window, second.packing.window) == (16, 8)  # a stage without a window keeps the recipe's
    assert (first.prompts.limit, second.prompts.limit) == (None, 10)
    trains = [plan.training for plan in (first, second)]
    assert [t.learning_rate for t in trains] == [1e-5, 5e-6] and [t.epochs for t in trains] == [2, 2]
    assert trains[1].model.name_or_path == second.model.name_or_path and trains[1].model.dtype == "float32"
    assert trains[1].output_dir == str(root / "n32" / "training")
    assert recipe.final_model() == str(root / "n32" / "training" / "latest" / "final")
    assert second.run_name("packing") == "packing (n32)"
    assert recipe.eval_config(recipe.final_model()).models["trained"].model.name_or_path == recipe.final_model()


@pytest.mark.parametrize(
    ("curriculum", "message"),
    [
        ([{"name": "a", "block_size": 16}, {"name": "a", "block_size": 32}], "stage names must differ"),
        ([{"name": "a", "block_size": 1}], "block_size must be >= 2"),
        (
            [{"name": "a", "block_size": 16, "training": {"output_dir": "x"}}],
            "curriculum[a].training.output_dir: set by the flow",
        ),
        ([{"name": "a", "block_size": 16, "training": {"lr": 1}}], "training (a): unknown key 'lr'"),
        ([{"name": "a/b", "block_size": 16}], "must be a plain folder name"),
        ([{"name": "a", "block_sise": 16}], "unknown key 'block_sise' (did you mean 'block_size'?)"),
        (
            [{"name": "a", "block_size": 16, "prompts": {"paht": "x.jsonl"}}],
            "curriculum[a].prompts: unknown key 'paht' (did you mean 'path'?)",
        ),
        (
            [{"name": "a", "block_size": 16, "prompts_limit": 5, "prompts": {"limit": 6}}],
            "prompts_limit and prompts.limit both set",
        ),
        (
            [{"name": "a", "block_size": 8, "anchor": "b"}, {"name": "b", "block_size": 8}],
            "curriculum[a].anchor: 'b' is not an earlier stage (earlier: [])",
        ),
    ],
)
def test_a_malformed_curriculum_names_the_stage(curriculum, message):
    with pytest.raises(ConfigError) as err:
        load_recipe(GOOD | {"curriculum": curriculum})
    assert message in str(err.value)


def test_the_learning_curve_is_every_export_of_each_stages_newest_run(tmp_path):
    recipe = load_recipe(
        GOOD
        | {
            "work_dir": str(tmp_path),
            "evaluation": {
                "learning_curve": {"benchmarks": [{"name": "gsm8k", "limit": 2}], "max_new_tokens": 8},
                "fp32_check": 3,
            },
            "curriculum": [{"name": "n4", "block_size": 4}, {"name": "n8", "block_size": 8}],
        }
    )

    def checkpoint(folder: Path, steps: int | None = None) -> None:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        if steps:
            (folder / "jacobi_forcing.json").write_text(json.dumps({"steps": steps}))

    for stage, run, exports, final in (("n4", "a1", [2, 4], 6), ("n8", "b1", [3], 3)):
        for step in exports:
            checkpoint(tmp_path / stage / "training" / run / "exports" / f"step-{step:07d}")
        checkpoint(tmp_path / stage / "training" / run / "final", final)
        (tmp_path / stage / "training" / "latest").symlink_to(run)
    checkpoint(tmp_path / "n4" / "training" / "old" / "exports" / "step-0000001")  # not the newest run: left out
    points = recipe.curve_points()
    assert [(p.label, p.block_size) for p in points] == [
        ("base", 4),
        ("n4@2", 4),
        ("n4@4", 4),
        ("n4@6", 4),
        ("n8@3", 8),
    ]
    assert points[-1].model.name_or_path == str(tmp_path / "n8" / "training" / "b1" / "final")  # the final model
    configs = recipe.curve_configs()
    assert list(configs) == [p.label for p in points]
    n8 = configs["n8@3"]
    assert (n8.decoding.block_size, n8.decoding.ngram_size, n8.decoding.max_new_tokens) == (8, 8, 8)
    assert set(n8.models) == {"n8@3"} and n8.baseline == "n8@3" and n8.output_dir == str(tmp_path / "curve")
    check = recipe.fp32_config(recipe.final_model())
    assert check.models["trained-fp32"].model.dtype == "float32" and check.output_dir == str(tmp_path / "fp32-check")
    assert [(b.name, b.limit) for b in check.benchmarks] == [("gsm8k", 3)]


def test_an_mlflow_server_that_does_not_answer_fails_at_once_saying_what_to_do():
    from tasks.tracking import ParentRun, TrackingConfig

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    began = time.perf_counter()
    with pytest.raises(ConfigError, match=r"no MLflow server answers at http://127.0.0.1:\d+ .*tracking.uri=null"):
        ParentRun(TrackingConfig(uri=f"http://127.0.0.1:{port}"), "run", {}, {})
    assert time.perf_counter() - began < 10


def test_an_unknown_curriculum_stage_is_named():
    from flows.jacobi_forcing import chosen_curriculum

    recipe = load_recipe(GOOD | {"curriculum": [{"name": "n16", "block_size": 16}, {"name": "n32", "block_size": 32}]})
    assert chosen_curriculum(recipe, None) == ["n16", "n32"] and chosen_curriculum(recipe, ["n32"]) == ["n32"]
    with pytest.raises(ConfigError, match="curriculum: unknown stage 'n64'; the recipe's stages are n16, n32"):
        chosen_curriculum(recipe, ["n64"])


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs" / "campaign").glob("*.yaml")))
def test_campaign_recipes_load(name):
    assert load_recipe(REPO / "configs" / "campaign" / name).stages()


def test_every_ablation_variant_is_a_valid_recipe():
    """bench.ablation's variants are overrides of the ablation recipe: a misspelt key would fail hours into a run."""
    from bench.ablation import CONTINUES, VARIANTS
    from jfcore.config import apply_overrides, load_file

    base = load_file(REPO / "configs" / "campaign" / "cpu-ablation.yaml")
    for name, (overrides, _) in VARIANTS.items():
        filled = [o.format(**{CONTINUES[name]: "runs/x"}) for o in overrides] if name in CONTINUES else overrides
        recipe = load_recipe(apply_overrides(base, filled))
        assert recipe.stages()[-1].training.acceptance.block_sizes == (4, 8), name


@pytest.mark.parametrize("name", ["eval_smollm2_cpu.yaml", "eval_smollm2_ablation_cpu.yaml"])
def test_evaluation_configs_load(name):
    """The jf-eval configs: every key known, both models and every benchmark named."""
    from cli.evaluate import SECTIONS
    from jfcore.config import load_sections

    config = load_sections(REPO / "configs" / name, SECTIONS, required=("evaluation",))["evaluation"]
    assert set(config.models) == {"base", "trained"} and config.benchmarks
