"""Real DeepSpeed training: 2 CPU processes over gloo, checkpoints, kill and resume, export, MLflow."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from jfcore.config import ConfigError, replace_checked
from jfcore.decoding import DecodeConfig, decode
from jfcore.hostspeed import scaled
from jfcore.models import ModelConfig, ModelLoadError
from jfcore.packing import PackingConfig
from jfcore.training.checkpoints import complete_checkpoints, read_metrics
from jfcore.training.config import AcceptanceConfig, TrainConfig
from jfcore.training.data import TrainingDataError
from tasks.tracking import TrackingConfig, client
from tasks.training import LaunchConfig, TrainingFailed, TrainingResult, run_training
from tests.support.servers import mlflow_server
from tests.support.tiny_models import greedy_reference, save_tiny_checkpoint
from tests.support.training_data import packed_data
from tests.support.training_jobs import CURVE, curve, kill_rank_1_at

STEPS = 12  # 16 sequences, 2 processes x micro batch 2: 4 steps an epoch, 3 epochs
# 20 prompts, of which this seed's hash holds out 4 (p4, p7, p15, p16): 16 to train on, 4 to measure acceptance on
HELDOUT = PackingConfig(heldout_fraction=0.2, heldout_seed=4)
ACCEPTANCE = AcceptanceConfig(every=4, block_sizes=(2, 4), prompts=4, tokens=12)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    checkpoint = save_tiny_checkpoint(root / "base", initializer_range=0.3)
    data = packed_data(checkpoint, root, prompts=20, heldout=HELDOUT)
    with mlflow_server(root / "mlflow") as uri:
        yield {"root": root, "checkpoint": checkpoint, "data": data, "mlflow": uri}


def config(setup, name: str, **changes) -> TrainConfig:
    values = {
        "data": str(setup["data"]),
        "output_dir": str(setup["root"] / name),
        "model": ModelConfig(name_or_path=str(setup["checkpoint"])),
        "epochs": 3,
        "micro_batch_size": 2,
        "learning_rate": 2e-3,
        "warmup_ratio": 0.1,
        "checkpoint_every": 4,
        "keep_checkpoints": 3,
        "acceptance": ACCEPTANCE,
    }
    return TrainConfig(**(values | changes))


LAUNCH = LaunchConfig(processes=2, deepspeed_config="zero2", threads_per_process=1)


def tracking(setup, run_name: str) -> TrackingConfig:
    return TrackingConfig(
        uri=setup["mlflow"], experiment="training-tests", run_name=run_name, registered_model="jf-tiny"
    )


def resumed_at(lines: list[str], run_dir: Path, step: int) -> None:
    """The training loop itself (not the launcher's folder listing) resumed from checkpoint `step`, and this
    launch ran exactly the steps after it: its progress lines go from step + 1 to the end, its worker says so."""
    checkpoint = Path(run_dir) / "checkpoints" / f"step-{step:07d}"
    assert any(f"resumed from step {step} (checkpoint {checkpoint})" in line for line in lines), lines
    progress = [int(m[1]) for line in lines if (m := re.search(rf"\bstep (\d+)/{STEPS}: loss", line))]
    ran = [] if step == STEPS else [step + 1, STEPS]  # a restart from 0 would begin at step 1
    assert progress == sorted(set(progress)) and progress[:1] + progress[-1:] == ran, progress
    assert any(f"training finished: {STEPS} steps (resumed from {step})" in line for line in lines)


def same_curve_and_weights(run_dir: Path, uninterrupted: TrainingResult, after: int, rel: float = 1e-5) -> None:
    """One record per step, and from step `after` on the same losses and final weights as the uninterrupted run
    (to `rel`: another split of the rows sums in another order)."""
    resumed, whole = curve(run_dir), curve(Path(uninterrupted.folder))
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(resumed[after:], whole[after:]):
        for key in CURVE:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-7), (a["step"], key)
    a = AutoModelForCausalLM.from_pretrained(Path(run_dir) / "final")
    b = AutoModelForCausalLM.from_pretrained(uninterrupted.final)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=rel, atol=1e-6, msg=name)


def crashed_copy(setup, uninterrupted: dict, name: str, during_step: int) -> TrainConfig:
    """The uninterrupted run's folder as a crash during `during_step` would have left it: the checkpoints
    before that step, a record for each step before it, no export."""
    whole, train = Path(uninterrupted.folder), config(setup, name)
    out = Path(train.output_dir)
    shutil.copytree(whole, out, ignore=shutil.ignore_patterns("final", "mlflow_run.json", "launch.log"))
    for tag in complete_checkpoints(out / "checkpoints"):
        if int(tag.removeprefix("step-")) >= during_step:
            shutil.rmtree(out / "checkpoints" / tag)
    kept = (out / "metrics.jsonl").read_text().splitlines(keepends=True)[: during_step - 1]
    (out / "metrics.jsonl").write_text("".join(kept))
    return train


@pytest.fixture(scope="module")
def uninterrupted(setup) -> TrainingResult:
    return run_training(config(setup, "whole"), LAUNCH, tracking(setup, "whole"), log=lambda line: None)


def test_loss_falls_and_every_metric_is_logged(setup, uninterrupted):
    records = curve(uninterrupted.folder)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    first, last = records[:4], records[-4:]  # first and last epoch: the same 16 sequences, reshuffled
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
    assert mean(last, "loss") < 0.8 * mean(first, "loss")
    assert mean(last, "ar_loss") < mean(first, "ar_loss")
    assert all(r["tokens_per_second"] > 0 and r["grad_norm"] > 0 for r in records)
    for r in records:  # the logged total is the logged parts put together with lambda = 10
        assert r["loss"] == pytest.approx(r["consistency_loss"] + 10 * r["ar_loss"], rel=1e-5)

    mlflow = client(tracking(setup, "whole"))
    run = mlflow.get_run(uninterrupted.mlflow_run_id)
    assert (
        run.data.params["training.ar_weight"] == "10.0" and run.data.params["deepspeed.zero_optimization.stage"] == "2"
    )
    assert run.data.params["launch.processes"] == "2"
    for name in (*CURVE, "tokens_per_second"):
        history = mlflow.get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), name
    losses = {m.step: m.value for m in mlflow.get_metric_history(run.info.run_id, "loss")}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in records})
    artifacts = {a.path for a in mlflow.list_artifacts(run.info.run_id, "training")}
    logged = ("deepspeed_config.json", "metrics.jsonl", "launch.json", "launch.log")
    assert {f"training/{name}" for name in logged} <= artifacts
    version = mlflow.get_model_version("jf-tiny", uninterrupted.version)
    assert version.run_id == run.info.run_id


def test_acceptance_is_measured_on_the_heldout_prompts_and_logged(setup, uninterrupted):
    stats = json.loads((setup["data"] / "stats.json").read_text())
    assert stats["sequences"] == 16 and sorted(stats["heldout_prompts"]) == ["p15", "p16", "p4", "p7"]
    records = read_metrics(Path(uninterrupted.folder) / "acceptance.jsonl")
    measured, decoded = records[:-1], records[-1]
    # Before the first step, every 4 steps and after the last; the two ranks' shares summed (4 prompts, 12 tokens).
    assert [r["step"] for r in measured] == [0, 4, 8, 12] and decoded["step"] == STEPS and decoded["decoded"]
    steps = curve(uninterrupted.folder)
    assert [r["tokens"] for r in measured] == [sum(s["tokens"] for s in steps[:k]) for k in (0, 4, 8, 12)]
    for r in measured:
        for n in (2, 4):  # 48 tokens in at least 48 / n forwards and at most 48
            assert 1.0 <= r[f"heldout/simulated_tpf_n{n}"] <= n
        assert 0.0 <= r["heldout/noisy_accuracy"] <= 1.0 and "heldout/noisy_accuracy_at_0" in r
        assert 0.0 <= r["heldout/text_kept"] <= 1.0 and 0.0 <= r["heldout/copyable_share"] <= 1.0
    assert measured[0]["heldout/text_kept"] == 1.0  # the trajectories are the untrained model's greedy text
    assert {f"heldout/decoded_tpf_n{n}" for n in (2, 4)} <= set(decoded) and 0 <= decoded[
        "heldout/greedy_unchanged"
    ] <= 1
    assert all(0 <= decoded[f"heldout/{k}repetition"] <= 1 for k in ("", "reference_"))
    mlflow = client(tracking(setup, "whole"))
    history = mlflow.get_metric_history(uninterrupted.mlflow_run_id, "heldout/simulated_tpf_n4")
    assert sorted((m.step, m.value) for m in history) == [
        (r["step"], pytest.approx(r["heldout/simulated_tpf_n4"])) for r in measured
    ]
    final = mlflow.get_metric_history(uninterrupted.mlflow_run_id, "heldout/decoded_multiblock_tpf_n4")
    assert [(m.step, m.value) for m in final] == [(STEPS, pytest.approx(decoded["heldout/decoded_multiblock_tpf_n4"]))]
    lines = (Path(uninterrupted.folder) / "launch.log").read_text().splitlines()
    assert any(
        re.search(r"step 8/12: held-out acceptance: simulated TPF n2 [\d.]+, simulated TPF n4", line) for line in lines
    )
    assert any(re.search(r"step 12/12: loss .*; held-out simulated TPF n2", line) for line in lines)


def test_registered_model_loads_from_mlflow_and_decodes_like_generate(setup, uninterrupted):
    import mlflow

    from jfcore.models import ModelConfig as MC
    from jfcore.models import load_model

    mlflow.set_tracking_uri(setup["mlflow"])
    uri = f"models:/jf-tiny/{uninterrupted.version}"
    defaults = {p.name: p.default for p in mlflow.models.get_model_info(uri).signature.params}
    assert defaults == {"method": "tuned", "block_size": 0, "max_new_tokens": 256}  # the model's own decoding
    served = mlflow.pyfunc.load_model(uri)
    texts = ["w5 w9 w11 w4", "w30 w7"]
    model, tokenizer = load_model(MC(name_or_path=uninterrupted.final))
    greedy = [greedy_reference(model, tokenizer(t)["input_ids"], 16, eos=tokenizer.eos_token_id) for t in texts]
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in greedy]
    # Untuned, the default is Jacobi at the trained block size; a caller may name another method.
    assert served.predict(texts, params={"max_new_tokens": 16}) == expected
    assert served.predict(texts, params={"method": "multiblock", "block_size": 3, "max_new_tokens": 16}) == expected


def test_exported_model_loads_and_decodes_losslessly(setup, uninterrupted):
    final = Path(uninterrupted.final)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(setup["checkpoint"], dtype=torch.float32)
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)  # it was trained
    prompts = [[1, 5, 9, 11, 4], [1, 30, 7], [1, 99, 98, 97, 50, 51, 52]]
    for method in ("jacobi", "multiblock"):
        out = decode(model, prompts, DecodeConfig(method=method, block_size=4, max_new_tokens=24), eos_token_id=2)
        for prompt, tokens in zip(prompts, out.sequences):
            assert tokens == greedy_reference(model, prompt, 24, eos=2)
    assert json.loads((final / "jacobi_forcing.json").read_text())["block_size"] == 4
    assert (final / "tokenizer.json").is_file()


def test_killed_worker_resumes_with_the_same_loss_curve(setup, uninterrupted):
    train = config(setup, "killed")
    killer, killed = kill_rank_1_at(Path(train.output_dir), step=4)
    with pytest.raises(TrainingFailed, match="resumes from the newest checkpoint") as failure:
        run_training(train, LAUNCH, tracking(setup, "killed"), log=lambda line: None)
    killer.join()
    launch_log = Path(train.output_dir) / "launch.log"
    assert str(launch_log) in str(failure.value) and "Root Cause" not in str(failure.value)  # no torchrun post-mortem
    assert killed, "the training finished before a rank could be killed"
    run_id = json.loads((Path(train.output_dir) / "mlflow_run.json").read_text())["run_id"]
    assert client(tracking(setup, "killed")).get_run(run_id).info.status == "FAILED"
    before = (Path(train.output_dir) / "metrics.jsonl").read_text().splitlines()

    lines: list[str] = []
    result = run_training(train, LAUNCH, tracking(setup, "killed"), log=lines.append)
    assert any("resuming from step-0000004" in line for line in lines)  # the launcher's guess
    resumed_at(lines, train.output_dir, 4)  # what the training loop did
    # Steps 1-4 were not redone: their records (timings included) are the killed launch's.
    assert (Path(train.output_dir) / "metrics.jsonl").read_text().splitlines()[:4] == before[:4]
    assert result.mlflow_run_id == run_id  # the same MLflow run continues
    launches = launch_log.read_text().split("\n=== ")  # both launches, the killed one's post-mortem included
    assert len(launches) == 2 and "Root Cause" in launches[0] and "training finished" in launches[1]
    same_curve_and_weights(train.output_dir, uninterrupted, after=4)


def test_one_process_with_the_whole_step_in_one_micro_batch_trains_like_two_processes(setup, uninterrupted):
    """Each step's 4 rows in one forward (1 process, micro batch 4) against 2 processes of 2 rows: the losses are
    means of per-row means, so how a step's rows are split must not change the curve or the weights."""
    one = LaunchConfig(processes=1, deepspeed_config="zero2", threads_per_process=1)
    result = run_training(config(setup, "one-wide", micro_batch_size=4), one, log=lambda line: None)
    same_curve_and_weights(Path(result.folder), uninterrupted, after=0, rel=1e-4)


def test_a_finished_run_is_not_retrained_and_changed_settings_are_refused(setup, uninterrupted):
    run_dir = Path(uninterrupted.folder)
    before = (run_dir / "final" / "model.safetensors").stat().st_mtime_ns
    mlflow = client(tracking(setup, "whole"))
    versions = len(mlflow.search_model_versions("name='jf-tiny'"))
    lines: list[str] = []
    again = run_training(config(setup, "whole"), LAUNCH, tracking(setup, "whole"), log=lines.append)
    resumed_at(lines, run_dir, STEPS)  # and ran no step
    assert [r["step"] for r in curve(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "final" / "model.safetensors").stat().st_mtime_ns == before
    assert again.mlflow_run_id == uninterrupted.mlflow_run_id and again.model == uninterrupted.model
    assert len(mlflow.search_model_versions("name='jf-tiny'")) == versions  # no second registration
    assert mlflow.get_run(again.mlflow_run_id).info.status == "FINISHED"
    with pytest.raises(TrainingFailed, match="other settings.*micro_batch_size: 2 -> 1"):
        run_training(config(setup, "whole", micro_batch_size=1), LAUNCH, log=lambda line: None)
    # ZeRO cannot load its optimizer shards into another world size: that is a changed setting too, not a
    # checkpoint to skip as unreadable.
    with pytest.raises(TrainingFailed, match="other settings.*world_size: 2 -> 1"):
        run_training(config(setup, "whole"), LaunchConfig(processes=1, threads_per_process=1), log=lambda line: None)


@pytest.mark.parametrize(
    ("damaged", "where"),
    [("mp_rank_00_model_states.pt", ""), ("zero_pp_rank_1_mp_rank_00_optim_states.pt", " on rank 1")],
)
def test_an_unreadable_checkpoint_falls_back_to_the_previous_complete_one(setup, uninterrupted, damaged, where):
    """A checkpoint file cut short (a full disk, a copy that stopped) makes the resume use the one before.
    With rank 1's optimizer file cut, rank 0 loads the newer checkpoint whole and rank 1 its weights before
    failing: both must agree to fall back, and the older load must replace all of that."""
    train = crashed_copy(setup, uninterrupted, f"fallback-{damaged[:4]}", during_step=10)
    checkpoints = Path(train.output_dir) / "checkpoints"
    assert complete_checkpoints(checkpoints) == ["step-0000004", "step-0000008"]
    with open(checkpoints / "step-0000008" / damaged, "r+b") as f:
        f.truncate(16)

    lines: list[str] = []
    run_training(train, LAUNCH, log=lines.append)
    warning = f"warning: checkpoint {checkpoints / 'step-0000008'} is unreadable{where} ("
    assert any(warning in line and "falling back to the previous complete one" in line for line in lines), lines
    resumed_at(lines, train.output_dir, 4)
    same_curve_and_weights(train.output_dir, uninterrupted, after=4)
    # Step 8 was saved again, whole: the next resume can use it.
    assert complete_checkpoints(checkpoints) == ["step-0000004", "step-0000008", "step-0000012"]
    size = lambda tag: (checkpoints / tag / damaged).stat().st_size
    assert size("step-0000008") == size("step-0000004")


def test_no_loadable_checkpoint_is_an_error_not_a_fresh_start(setup, uninterrupted):
    """Weights half-loaded from a broken checkpoint must not be trained on as if from step 0."""
    train = crashed_copy(setup, uninterrupted, "unloadable", during_step=10)
    checkpoints = Path(train.output_dir) / "checkpoints"
    for tag in complete_checkpoints(checkpoints):
        (checkpoints / tag / "mp_rank_00_model_states.pt").unlink()
    lines: list[str] = []
    with pytest.raises(TrainingFailed, match="none of the complete checkpoints.*step-0000004, step-0000008"):
        run_training(train, LAUNCH, log=lines.append)
    for tag, then in (("step-0000008", "falling back to the previous complete one"), ("step-0000004", "no older")):
        assert any(f"checkpoint {checkpoints / tag} is unreadable" in line and then in line for line in lines), tag
    assert len(curve(train.output_dir)) == 9 and not (Path(train.output_dir) / "final").exists()


def test_a_metrics_line_torn_by_a_crash_is_dropped_on_resume(setup, uninterrupted):
    train = crashed_copy(setup, uninterrupted, "torn", during_step=10)
    metrics = Path(train.output_dir) / "metrics.jsonl"
    step_10 = (Path(uninterrupted.folder) / "metrics.jsonl").read_text().splitlines()[9]
    with open(metrics, "a") as f:
        f.write(step_10[: len(step_10) // 2])  # killed while writing step 10's record

    lines: list[str] = []
    result = run_training(train, LAUNCH, log=lines.append)
    assert any(f"warning: {metrics} line 10 is torn" in line for line in lines), lines
    resumed_at(lines, train.output_dir, 8)
    same_curve_and_weights(train.output_dir, uninterrupted, after=8)
    assert result.metrics["step"] == STEPS


def test_curriculum_stage_starts_from_the_previous_export_with_zero3(setup, uninterrupted):
    """Stage 2: trajectories of block size 8 from stage 1's model, trained from it under ZeRO-3
    with gradient checkpointing."""
    stage1 = Path(uninterrupted.final)
    data = packed_data(stage1, setup["root"] / "stage2-data", block_size=8, max_new_tokens=16)
    train = config(
        setup,
        "stage2",
        data=str(data),
        model=ModelConfig(name_or_path=str(stage1)),
        epochs=1,
        max_steps=3,
        checkpoint_every=2,
        gradient_checkpointing=True,
    )
    result = run_training(
        train, LaunchConfig(processes=2, deepspeed_config="zero3", threads_per_process=1), log=lambda line: None
    )
    assert [r["step"] for r in curve(train.output_dir)] == [1, 2, 3]
    model = AutoModelForCausalLM.from_pretrained(result.final)  # ZeRO-3 shards gathered into one model
    before = AutoModelForCausalLM.from_pretrained(stage1)
    assert model.state_dict().keys() == before.state_dict().keys()
    assert not torch.equal(model.lm_head.weight, before.lm_head.weight)
    assert json.loads((Path(result.final) / "jacobi_forcing.json").read_text())["block_size"] == 8


def test_bad_inputs_fail_before_any_process_starts(setup, tmp_path):
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        bad = tmp_path / "ds.json"
        bad.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}))
        run_training(config(setup, "x"), LaunchConfig(deepspeed_config=str(bad)))
    with pytest.raises(ConfigError, match="zero7.*zero0, zero1, zero2, zero3, zero3_offload"):
        run_training(config(setup, "x"), LaunchConfig(deepspeed_config="zero7"))
    with pytest.raises(TrainingDataError, match="no stats.json"):
        run_training(config(setup, "x", data=str(tmp_path)), LAUNCH)
    with pytest.raises(ModelLoadError):
        run_training(config(setup, "x", model=ModelConfig(name_or_path=str(tmp_path / "missing"))), LAUNCH)
    other = save_tiny_checkpoint(tmp_path / "other", vocab_size=64)
    with pytest.raises(TrainingDataError, match="tokenizer fingerprint"):
        run_training(config(setup, "x", model=ModelConfig(name_or_path=str(other))), LAUNCH)
    with pytest.raises(ConfigError, match="precision"):
        config(setup, "x", model=ModelConfig(name_or_path="m", dtype="bfloat16"))
    assert not (setup["root"] / "x").exists()  # nothing was started or written


@pytest.mark.parametrize("deepspeed_config", ["zero0", "zero1", "zero3_offload"])
def test_every_shipped_deepspeed_config_trains_and_exports(setup, uninterrupted, deepspeed_config, monkeypatch):
    """zero2 and zero3 run above; the other files under infra/deepspeed/ must work as shipped too.
    The paths are relative to the caller's working folder, as in a recipe."""
    monkeypatch.chdir(setup["root"])
    train = config(setup, f"ds-{deepspeed_config}", max_steps=2, checkpoint_every=2)
    train = replace_checked(
        train,
        data=os.path.relpath(train.data),
        output_dir=f"ds-{deepspeed_config}",
        model={"name_or_path": os.path.relpath(setup["checkpoint"])},
    )
    result = run_training(
        train,
        LaunchConfig(processes=2, deepspeed_config=deepspeed_config, threads_per_process=1),
        log=lambda line: None,
    )
    records = curve(train.output_dir)
    assert [r["step"] for r in records] == [1, 2] and all(r["grad_norm"] > 0 for r in records)
    stage = json.loads((Path(train.output_dir) / "deepspeed_config.json").read_text())["zero_optimization"]["stage"]
    assert stage == {"zero0": 0, "zero1": 1, "zero3_offload": 3}[deepspeed_config]
    # Same weights and rows at step 1 as the ZeRO-2 run: the same loss and gradient norm, however sharded.
    first = curve(Path(uninterrupted.folder))[0]
    assert records[0]["loss"] == pytest.approx(first["loss"], rel=1e-5)
    assert records[0]["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-4)
    assert AutoModelForCausalLM.from_pretrained(result.final).num_parameters() > 0


def test_a_frozen_teacher_starts_at_zero_kl_with_the_models_own_consistency_targets(setup, uninterrupted):
    """Before its first update the model is its frozen teacher: KL 0, and the same consistency loss as the run whose
    teacher is the model's own clean stream (float32). After updates the model drifts from it and L_AR shows it."""
    train = config(setup, "frozen", teacher="frozen", ar_weight=1.0, max_steps=4, acceptance=AcceptanceConfig(every=0))
    run_training(train, LAUNCH, log=lambda line: None)
    records, own = curve(train.output_dir), curve(Path(uninterrupted.folder))[0]
    assert records[0]["ar_loss"] < 1e-5 < own["ar_loss"]
    assert records[0]["consistency_loss"] == pytest.approx(own["consistency_loss"], rel=1e-4)
    assert records[1]["ar_loss"] < 1e-5  # step 1 ran at the warmup's rate 0
    assert all(r["ar_loss"] > 1e-4 for r in records[2:])


def test_lora_trains_adapters_only_and_exports_a_merged_plain_checkpoint(setup):
    from jfcore.training.config import LoraConfig

    lora = LoraConfig(rank=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    train = config(setup, "lora", lora=lora, learning_rate=1e-2)
    result = run_training(train, LAUNCH, TrackingConfig(), log=lambda line: None)
    records = curve(result.folder)
    assert sum(r["loss"] for r in records[-4:]) < sum(r["loss"] for r in records[:4])
    model = AutoModelForCausalLM.from_pretrained(result.final, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(setup["checkpoint"], dtype=torch.float32)
    trained, untouched = model.state_dict(), base.state_dict()
    assert trained.keys() == untouched.keys()  # the base architecture's names: no adapter weights left over
    for name, weight in trained.items():  # adapted layers changed (the merge happened), nothing else did
        adapted = name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
        assert torch.equal(weight, untouched[name]) != adapted, name
    prompts = [[1, 5, 9, 11, 4], [1, 30, 7]]
    out = decode(model, prompts, DecodeConfig(method="jacobi", block_size=4, max_new_tokens=24), eos_token_id=2)
    for prompt, tokens in zip(prompts, out.sequences):
        assert tokens == greedy_reference(model, prompt, 24, eos=2)
    assert json.loads((Path(result.final) / "jacobi_forcing.json").read_text())["training"]["lora"]["rank"] == 8


def two_nodes(setup, name: str, port: int, log=lambda line: None) -> list:
    """Two launcher agents of one process each, meeting at one c10d rendezvous on this machine (as two nodes
    would); returns what each run_training call returned or raised."""
    results: list = [None, None]

    def node(rank: int) -> None:
        launch = replace_checked(
            LAUNCH, processes=1, nodes=2, node_rank=rank, rendezvous=f"127.0.0.1:{port}", rendezvous_timeout_s=300
        )
        try:
            results[rank] = run_training(config(setup, name), launch, TrackingConfig(), log=log)
        except Exception as err:  # noqa: BLE001 (the test inspects it)
            results[rank] = err

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_two_nodes_train_like_one_node_and_resume_after_a_node_dies(setup, uninterrupted):
    """Same per-step losses as the one-node two-process run; a node lost mid-run (its whole process session
    killed) fails the job, and running both nodes again resumes from the newest checkpoint."""
    from tests.support.servers import free_port
    from tests.support.training_jobs import rank_processes

    results = two_nodes(setup, "two-nodes", free_port())
    assert all(isinstance(r, TrainingResult) for r in results), results
    same_curve_and_weights(Path(results[0].folder), uninterrupted, after=0)

    out = Path(config(setup, "two-nodes-killed").output_dir)
    killed: list[int] = []

    def kill_node_1() -> None:
        deadline = time.time() + scaled(900)
        while not (out / "checkpoints" / "step-0000004" / "jf_complete.json").is_file() and time.time() < deadline:
            time.sleep(0.05)
        pid = rank_processes(out / "launch.json").get(1)
        if pid:
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # the node's agent and its process, as if it went down
            killed.append(pid)

    killer = threading.Thread(target=kill_node_1)
    killer.start()
    first = two_nodes(setup, "two-nodes-killed", free_port())
    killer.join()
    assert killed and all(isinstance(r, TrainingFailed) for r in first), first
    lines: list[str] = []
    again = two_nodes(setup, "two-nodes-killed", free_port(), log=lines.append)
    assert all(isinstance(r, TrainingResult) for r in again), again
    resumed = max(int(m[1]) for line in lines if (m := re.search(r"resumed from step (\d+)", line)))
    assert resumed >= 4
    same_curve_and_weights(out, uninterrupted, after=resumed)
