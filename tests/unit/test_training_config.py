"""Training config strictness and the resumable data order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jfcore.config import ConfigError, from_dict
from jfcore.training.config import TrainConfig
from jfcore.training.data import DataOrder
from jfcore.training.loop import deepspeed_config, lr_scheduler
from tests.support import REPO


def test_unknown_and_invalid_keys_are_named():
    with pytest.raises(ConfigError, match="unknown key 'learning_rat'.*did you mean 'learning_rate'"):
        from_dict(TrainConfig, {"data": "d", "output_dir": "o", "learning_rat": 1e-5})
    with pytest.raises(ConfigError, match="train.model: unknown key 'nme'"):
        from_dict(TrainConfig, {"data": "d", "output_dir": "o", "model": {"nme": "x"}}, "train")
    with pytest.raises(ConfigError, match="missing required key.*data"):
        from_dict(TrainConfig, {"output_dir": "o"})
    for key, value, message in [
        ("micro_batch_size", 0, "micro_batch_size"),
        ("learning_rate", -1.0, "learning_rate"),
        ("warmup_ratio", 1.5, "warmup_ratio"),
        ("lr_schedule", "linear", "lr_schedule"),
        ("temperature", 0.0, "temperature"),
        ("precision", "fp8", "precision"),
        ("betas", [0.9], "betas"),
        ("export_steps", [10, 0], "export_steps"),
        ("consistency_offsets", 0, "consistency_offsets: must be >= 1"),
        ("ar_margin", 0.0, "ar_margin: must be > 0"),
        ("ar_loss", "hinge", "ar_loss"),
        ("consistency_copies", "drop", "consistency_copies"),
        ("acceptance", {"every": -1}, "AcceptanceConfig.every: must be >= 0"),
        ("acceptance", {"block_sizes": [8, 1]}, "Jacobi blocks are >= 2 tokens"),
        ("acceptance", {"prompts": 0}, "AcceptanceConfig.prompts"),
        ("acceptance", {"evry": 5}, "unknown key 'evry'.*did you mean 'every'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            from_dict(TrainConfig, {"data": "d", "output_dir": "o", key: value})


def test_acceptance_and_ar_settings_load_from_plain_data():
    config = from_dict(
        TrainConfig,
        {"data": "d", "output_dir": "o", "ar_on_prompt": True, "acceptance": {"every": 20, "block_sizes": [4, 8]}},
    )
    assert config.ar_on_prompt and config.acceptance.every == 20 and config.acceptance.block_sizes == (4, 8)
    default = TrainConfig(data="d", output_dir="o")
    assert not default.ar_on_prompt and default.acceptance.every > 0 and default.acceptance.block_sizes == ()


def test_wsd_schedule_holds_the_rate_then_decays_it_linearly_to_zero():
    with pytest.raises(ConfigError, match=r"decay_ratio: must be in \(0, 1 - warmup_ratio = 0.97\], got 0.99"):
        TrainConfig(data="d", output_dir="o", lr_schedule="wsd", decay_ratio=0.99)
    TrainConfig(data="d", output_dir="o", warmup_ratio=0.9)  # another schedule: decay_ratio is not read
    config = TrainConfig(
        data="d", output_dir="o", learning_rate=1.0, warmup_ratio=0.1, lr_schedule="wsd", decay_ratio=0.4
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler, rates = lr_scheduler(optimizer, config, total=20), []
    for _ in range(20):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:3] == [0.0, 0.5, 1.0]  # 2 warmup steps
    assert rates[2:12] == [1.0] * 10  # held until the last 8 steps
    assert rates[12:] == pytest.approx([1 - k / 8 for k in range(8)])


def test_deepspeed_file_may_not_set_what_the_training_config_owns():
    config = TrainConfig(data="d", output_dir="o", micro_batch_size=2, gradient_accumulation_steps=3)
    merged = deepspeed_config({"zero_optimization": {"stage": 3}}, config, world_size=4, bf16=True)
    assert merged["train_batch_size"] == 2 * 3 * 4 and merged["bf16"] == {"enabled": True}
    assert merged["zero_optimization"] == {"stage": 3}
    with pytest.raises(ConfigError, match="gradient_clipping"):
        deepspeed_config({"gradient_clipping": 5.0}, config, world_size=1, bf16=False)


def test_data_order_covers_each_epoch_once_and_splits_ranks():
    order = DataOrder(num_rows=23, micro_batch=2, world_size=2, accumulation=2, seed=7)
    assert order.global_batch == 8 and order.steps_per_epoch == 2  # 7 rows of each epoch are left over
    for epoch in range(3):
        seen = [
            i for step in (2 * epoch, 2 * epoch + 1) for a in range(2) for r in range(2) for i in order.rows(step, a, r)
        ]
        assert len(seen) == 16 == len(set(seen))  # no row twice within an epoch, ranks disjoint
    assert order.rows(0, 0, 0) != order.rows(2, 0, 0)  # each epoch is reshuffled
    again = DataOrder(num_rows=23, micro_batch=2, world_size=2, accumulation=2, seed=7)
    assert again.rows(5, 1, 1) == order.rows(5, 1, 1)  # a pure function of the step: resumable
    assert DataOrder(23, 2, 2, 2, seed=8).rows(0, 0, 0) != order.rows(0, 0, 0)


def test_cli_reports_a_bad_recipe_in_one_line(tmp_path):
    recipe = tmp_path / "train.yaml"
    recipe.write_text("training: {data: d, output_dir: o}\nlaunh: {processes: 2}\n")
    done = subprocess.run(
        [sys.executable, "-m", "cli.train", "--config", str(recipe)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {recipe}: unknown section(s) launh; use training, launch, tracking"
    )
    recipe.write_text("training: {data: d, output_dir: o}\n")
    done = subprocess.run(
        [sys.executable, "-m", "cli.train", "--config", str(recipe), "--set", "training.epoch=2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 1 and "unknown key 'epoch' (did you mean 'epochs'?)" in done.stderr.splitlines()[-1]


def test_multi_node_launch_settings_are_checked():
    from tasks.training import LaunchConfig, _rendezvous

    with pytest.raises(ConfigError, match="rendezvous"):
        LaunchConfig(nodes=2)
    with pytest.raises(ConfigError, match="node_rank"):
        LaunchConfig(nodes=2, node_rank=2, rendezvous="10.0.0.1:29400")
    args = _rendezvous(LaunchConfig(nodes=2, node_rank=1, rendezvous="10.0.0.1:29400"), Path("/runs/a/launch.json"))
    assert "--nnodes=2" in args and "--rdzv-endpoint=10.0.0.1:29400" in args and "--standalone" not in args
    same_job = _rendezvous(LaunchConfig(nodes=2, rendezvous="10.0.0.1:29400"), Path("/runs/a/launch.json"))
    assert [a for a in args if a.startswith("--rdzv-id")] == [a for a in same_job if a.startswith("--rdzv-id")]
    assert _rendezvous(LaunchConfig(), Path("/runs/a/launch.json")) == ["--standalone"]
