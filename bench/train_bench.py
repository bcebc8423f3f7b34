"""Training throughput: packed tokens/s of the DeepSpeed job under several launch settings, in ONE run.

Makes SmolLM2 packed data once with the data-path stage (16 builtin prompts, n = 16, 32 new
tokens; reused from --data if given), then launches `tasks.training.run_training` for every
setting in turn, `--steps` optimizer steps each, from a fresh output folder. The rate of a
setting is the median of its per-step tokens/s after the first step (the first carries
DeepSpeed's and the allocator's warm-up); "tokens" are the real tokens of the packed sequences
(prompt + noisy + clean). Ratios are against the first setting. `--rounds 2` runs the
list twice in alternating order, since this host's speed drifts. `--recipe` trains under a
recipe's `training` section (its losses, precision and batch) instead of the defaults, e.g. on
that recipe's own packed data. See docs/BENCHMARKS.md.

    python -m bench.train_bench --steps 8
    python -m bench.train_bench --recipe configs/campaign/cpu-2h.yaml --data runs/ablation/packing/<key> \
        --settings 1proc_zero0_bf16 --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, environment
from jfcore.config import from_dict, load_file, to_dict
from jfcore.models import ModelConfig, load_tokenizer
from jfcore.packing import PackingConfig
from jfcore.prompts import PromptSource
from jfcore.training.config import TrainConfig
from jfcore.trajectories import TrajectoryConfig
from tasks.packing import pack_trajectories
from tasks.training import LaunchConfig, run_training
from tasks.trajectories import RayConfig, generate_trajectories

# name -> (processes, threads per process, DeepSpeed config, gradient checkpointing, precision)
SETTINGS = {
    "1proc_zero0": (1, 2, "zero0", False, "float32"),
    "1proc_zero0_bf16": (1, 2, "zero0", False, "bfloat16"),
    "2proc_zero0": (2, 1, "zero0", False, "float32"),
    "2proc_zero2": (2, 1, "zero2", False, "float32"),
    "2proc_zero2_gc": (2, 1, "zero2", True, "float32"),
    "2proc_zero3": (2, 1, "zero3", False, "float32"),
    "2proc_zero2_bf16": (2, 1, "zero2", False, "bfloat16"),
}


def make_data(root: Path, model: ModelConfig, limit: int) -> Path:
    trajectories = generate_trajectories(
        model,
        PromptSource(limit=limit),
        TrajectoryConfig(block_size=16, max_new_tokens=32, batch_size=8),
        RayConfig(num_workers=1, cpus_per_worker=os.cpu_count() or 1),
        root / "trajectories",
        prompts_per_shard=8,
    )
    pad = load_tokenizer(model).pad_token_id
    pack_trajectories(trajectories, root / "packed", PackingConfig(pad_token_id=pad))
    return root / "packed"


def measure(name: str, data: Path, model: ModelConfig, steps: int, root: Path, recipe: dict | None = None) -> dict:
    """`recipe`: TrainConfig values (a recipe's `training` section) under this run's own data, folder and length."""
    processes, threads, deepspeed, checkpointing, precision = SETTINGS[name]
    train = from_dict(
        TrainConfig,
        {
            "learning_rate": 1e-5,
            **(recipe or {}),
            "precision": precision,
            "gradient_checkpointing": checkpointing,
            "max_steps": steps,
            "checkpoint_every": 10**6,
            "acceptance": {"every": 0},  # throughput alone
            "data": str(data),
            "output_dir": str(root / f"{name}-{time.time_ns()}"),
            "model": to_dict(model),
        },
    )
    began = time.perf_counter()
    run_training(
        train,
        LaunchConfig(processes=processes, deepspeed_config=deepspeed, threads_per_process=threads),
        log=lambda line: None,
    )
    wall = time.perf_counter() - began
    records = [json.loads(line) for line in (Path(train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_second"] for r in records[1:]]
    seconds = [r["tokens"] / r["tokens_per_second"] for r in records[1:]]
    return {
        "setting": name,
        "processes": processes,
        "threads": threads,
        "deepspeed": deepspeed,
        "gradient_checkpointing": checkpointing,
        "precision": precision,
        "tokens_per_second": statistics.median(rates),
        # All steps after the first, as a whole: a data order whose steps differ in length (length_grouped) has
        # long and short steps, and a fixed cost per step makes their median rate misleading.
        "overall_tokens_per_second": sum(r["tokens"] for r in records[1:]) / sum(seconds),
        "mean_step_seconds": statistics.mean(seconds),
        "step_rates": rates,
        "wall_s": wall,
        "first_loss": records[0]["loss"],
        "losses": [r["loss"] for r in records],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=ModelConfig().name_or_path)
    p.add_argument("--data", type=Path, help="a packing output folder (default: made from 16 builtin prompts)")
    p.add_argument("--prompts", type=int, default=16, help="builtin prompts for the data (default 16)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    p.add_argument("--rounds", type=int, default=1, help="repeat the list, reversed every other round")
    p.add_argument("--recipe", type=Path, help="train under this recipe's `training` section (default: the defaults)")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/train_<model>_cpu.json)")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown setting(s) {unknown}; choose from {', '.join(SETTINGS)}")
    model = ModelConfig(name_or_path=args.model)
    recipe = load_file(args.recipe).get("training", {}) if args.recipe else None
    with tempfile.TemporaryDirectory(prefix="jf-train-bench-") as tmp:
        root = Path(tmp)
        data = args.data or make_data(root, model, args.prompts)
        results: dict[str, list[dict]] = {n: [] for n in names}
        for round_index in range(args.rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                results[name].append(measure(name, data, model, args.steps, root, recipe))
                last = results[name][-1]
                print(
                    f"  {name}: {last['tokens_per_second']:.1f} tokens/s (median step), "
                    f"{last['overall_tokens_per_second']:.1f} overall, {last['mean_step_seconds']:.2f} s a step",
                    flush=True,
                )
    base = statistics.median(r["tokens_per_second"] for r in results[names[0]])
    print(f"\n{'setting':<18}{'procs':>6}{'tokens/s':>10}{'vs ' + names[0]:>20}{'first loss':>12}")
    rows = []
    for name in names:
        rate = statistics.median(r["tokens_per_second"] for r in results[name])
        rows.append({"setting": name, "tokens_per_second": rate, "ratio": rate / base, "runs": results[name]})
        print(
            f"{name:<18}{SETTINGS[name][0]:>6}{rate:>10.1f}{rate / base:>19.2f}x{results[name][0]['first_loss']:>12.4f}"
        )
    tag = Path(args.model).name.replace(".", "_")
    out = args.out or RESULTS / f"train_{tag}_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"environment": environment(model), "steps": args.steps, "recipe": recipe, "results": rows}, indent=1
        )
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
