"""Reruns of `jacobi-forcing/full` on one work_dir, as scheduled retraining makes them, on the real stack
(Prefect server and process worker, MLflow server, DeepSpeed on CPU, tiny model; the stages' one worker runs in
the flow's process, `ray.address: none`: test_pipeline_deployment runs them on Ray). One story, in order: a first
run; a new learning rate; `resume: false`; 8 appended prompts with a champion in the registry; two runs at once
(the second finds nothing changed); deleted packed data; retraining from the champion. Each test checks one step
against what MLflow and the files hold."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from tests.support.flow_stack import TINY_TUNE, finish, start_run, start_stack, stop_stack
from tests.support.tiny_models import save_tiny_checkpoint

MODEL = "jf-retrain-tiny"
EXPERIMENT = "jf-retraining"
PROMPTS = 12


def _prompt(i: int) -> str:
    return json.dumps({"prompt": " ".join(f"w{(7 * i + j) % 120 + 3}" for j in range(3 + i % 5))}) + "\n"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Story:
    def __init__(self, stack: dict, root: Path):
        self.stack, self.root = stack, root
        self.work = root / "work"
        self.prompts = root / "prompts.jsonl"
        self.prompts.write_text("".join(_prompt(i) for i in range(PROMPTS)))
        self.model = save_tiny_checkpoint(root / "base", initializer_range=0.3)

    def recipe(self, learning_rate: float, retrain_from: str = "base") -> Path:
        path = self.root / f"recipe-{learning_rate}-{retrain_from}.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "work_dir": str(self.work),
                    "model": {"name_or_path": str(self.model)},
                    "prompts": {"path": str(self.prompts), "chat_template": False},
                    "trajectories": {"block_size": 4, "max_new_tokens": 12, "batch_size": 4},
                    "prompts_per_shard": 4,
                    "ray": {"address": "none"},
                    "training": {
                        "max_steps": 6,
                        "epochs": 10,
                        "micro_batch_size": 2,
                        "learning_rate": learning_rate,
                        "checkpoint_every": 3,
                    },
                    "launch": {"processes": 1, "threads_per_process": 1},
                    "tuning": TINY_TUNE,
                    "evaluation": {
                        "benchmarks": [{"name": "gsm8k", "limit": 2, "seed": 0}, {"name": "humaneval", "limit": 1}],
                        "decoding": {
                            "max_new_tokens": 16,
                            "block_size": 4,
                            "warmup_tokens": 2,
                            "methods": ["hf_greedy", "multiblock", "tuned"],
                        },
                    },
                    "tracking": {"uri": self.stack["mlflow"], "experiment": EXPERIMENT, "registered_model": MODEL},
                    "retrain_from": retrain_from,
                }
            )
        )
        return path

    def run(self, learning_rate: float, retrain_from: str = "base", **params) -> dict:
        flow_run = start_run(self.stack, self.recipe(learning_rate, retrain_from), **params)
        return self.after(flow_run)

    def after(self, flow_run: str, logs: str | None = None) -> dict:
        logs = logs or finish(self.stack, flow_run)
        return {
            "id": flow_run,
            "logs": logs,
            "latest": (self.work / "training" / "latest").resolve(),
            "versions": self.versions(),
        }

    def versions(self) -> list[str]:
        return sorted((v.version for v in self.mlflow.search_model_versions(f"name='{MODEL}'")), key=int)

    @property
    def mlflow(self):
        from mlflow import MlflowClient

        return MlflowClient(self.stack["mlflow"])

    def registered_weights(self, version: str) -> str:
        import mlflow

        mlflow.set_tracking_uri(self.stack["mlflow"])
        folder = Path(
            mlflow.artifacts.download_artifacts(f"models:/{MODEL}/{version}", dst_path=str(self.root / f"v{version}"))
        )
        [weights] = list(folder.rglob("model.safetensors"))
        return sha256(weights)


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    root = tmp_path_factory.mktemp("retraining")
    stack = start_stack(root)
    try:
        s = Story(stack, root)
        steps = {
            "first": s.run(2.0e-3),
            "new_lr": s.run(1.0e-3),
            "fresh": s.run(1.0e-3, resume=False),
        }
        s.mlflow.set_registered_model_alias(MODEL, "champion", "1")  # as if v1 had passed an earlier gate
        with s.prompts.open("a") as f:
            f.write("".join(_prompt(i) for i in range(PROMPTS, PROMPTS + 8)))
        steps["appended"] = s.run(1.0e-3)
        # Two runs at once: one trains a new learning rate, the other waits for the work_dir, then finds it done
        # (an unchanged rerun).
        ids = [start_run(stack, s.recipe(5.0e-4)) for _ in range(2)]
        steps["together"] = [s.after(i) for i in ids]
        packed = json.loads((s.work / "training" / "latest" / "launch.json").read_text())["training"]["data"]
        steps["packed"] = packed
        for f in Path(packed).glob("packed-*.parquet"):
            f.unlink()
        steps["repacked"] = s.run(5.0e-4)
        steps["champion"] = s.mlflow.get_model_version_by_alias(MODEL, "champion").version
        steps["from_champion"] = s.run(5.0e-4, retrain_from="champion")
        yield s, steps
    finally:
        stop_stack(stack)


def _train_run(story: Story, folder: Path) -> str:
    return json.loads((folder / "mlflow_run.json").read_text())["run_id"]


def test_unchanged_inputs_say_nothing_changed_and_register_nothing(story):
    _, steps = story
    assert steps["first"]["versions"] == ["1"]
    [unchanged] = [r for r in steps["together"] if "waiting for flow run" in r["logs"]]
    logs = unchanged["logs"]
    assert f"{PROMPTS + 8} already decoded with this model and settings (reused), 0 to decode" in logs
    assert "packing: reused" in logs and f"training: reused {unchanged['latest']}" in logs
    assert "nothing changed" in logs and "v5 was already judged" in logs
    assert unchanged["versions"] == ["1", "2", "3", "4", "5"]


def test_a_new_learning_rate_trains_a_new_folder_and_registers_its_weights(story):
    s, steps = story
    first, new = steps["first"]["latest"], steps["new_lr"]["latest"]
    assert new != first and new.parent == first.parent
    assert json.loads((new / "launch.json").read_text())["training"]["learning_rate"] == 1.0e-3
    assert "resumed from step" not in steps["new_lr"]["logs"]  # a new run: nothing to resume
    assert steps["new_lr"]["versions"] == ["1", "2"]
    assert s.registered_weights("2") == sha256(new / "final" / "model.safetensors")
    assert s.registered_weights("2") != s.registered_weights("1")
    assert _train_run(s, new) != _train_run(s, first)
    assert s.mlflow.get_model_version(MODEL, "2").run_id == _train_run(s, new)


def test_resume_false_starts_a_new_run_with_its_own_mlflow_run(story):
    s, steps = story
    before, fresh = steps["new_lr"]["latest"], steps["fresh"]["latest"]
    assert fresh.name == before.name + ".2"
    assert steps["fresh"]["versions"] == ["1", "2", "3"]
    assert s.mlflow.get_model_version(MODEL, "3").run_id == _train_run(s, fresh) != _train_run(s, before)
    assert s.registered_weights("3") == sha256(fresh / "final" / "model.safetensors")
    assert "training into " + str(fresh) in steps["fresh"]["logs"]


def test_appended_prompts_are_the_only_ones_decoded_and_gated_against_the_champion(story):
    s, steps = story
    logs = steps["appended"]["logs"]
    assert f"{PROMPTS} already decoded with this model and settings (reused), 8 to decode" in logs
    assert steps["appended"]["versions"] == ["1", "2", "3", "4"]
    assert s.mlflow.get_run(s.mlflow.get_model_version(MODEL, "4").run_id).info.status == "FINISHED"
    evaluations = [
        r
        for r in s.mlflow.search_runs([s.mlflow.get_experiment_by_name(EXPERIMENT).experiment_id])
        if r.data.tags.get("jacobi_forcing.stage") == "evaluation"
    ]
    newest = max(evaluations, key=lambda r: r.info.start_time)
    # champion, base and trained decoded the same problems in this one evaluation
    assert {
        "gsm8k/champion/multiblock/accuracy",
        "gsm8k/base/hf_greedy/accuracy",
        "gsm8k/trained/multiblock/accuracy",
    } <= set(newest.data.metrics)
    reason = s.mlflow.get_model_version(MODEL, "4").tags["jacobi_forcing.gate.reason"]
    assert "tuned vs champion v1's tuned: " in reason and "gate: v4 " in logs


def test_two_runs_at_once_both_end_cleanly_one_after_the_other(story):
    _, steps = story
    a, b = steps["together"]
    waited = [r for r in (a, b) if "waiting for flow run" in r["logs"]]
    assert len(waited) == 1  # the second waited for the first to let go of the work_dir
    assert b["versions"][-1] == "5" and a["versions"] == b["versions"]  # one new version, not two
    latest = a["latest"]
    sums = json.loads((latest / "export.json").read_text())
    assert sums and all(sha256(latest / "final" / name) == digest for name, digest in sums.items())


def test_deleted_packed_data_is_packed_again_not_reused(story):
    _, steps = story
    logs = steps["repacked"]["logs"]
    assert "packing: reused" not in logs and "is missing or unreadable" in logs
    assert len(list(Path(steps["packed"]).glob("packed-*.parquet"))) >= 1
    assert "nothing changed" in logs  # the same data again: training is reused
    assert steps["repacked"]["versions"] == steps["together"][1]["versions"]


def test_retraining_from_the_champion_decodes_and_trains_from_its_weights(story):
    s, steps = story
    champion, logs = steps["champion"], steps["from_champion"]["logs"]
    assert f"retrain_from champion: training starts from {MODEL} v{champion}" in logs
    # another model: its own trajectory store, so every prompt is decoded with it
    assert f"{PROMPTS + 8} prompts (0 skipped: over 512 tokens): 0 already decoded" in logs
    launch = json.loads((steps["from_champion"]["latest"] / "launch.json").read_text())
    start = Path(launch["training"]["model"]["name_or_path"])
    assert start.is_relative_to(s.work / "registry")
    assert sha256(start / "model.safetensors") == s.registered_weights(champion)
    assert len(steps["from_champion"]["versions"]) == len(steps["repacked"]["versions"]) + 1
