"""What the pipeline produces on a tiny model, as digests: to show a refactor changed no behaviour.

Runs the `jacobi-forcing` flow in this process (Prefect's ephemeral API, no MLflow) on the tiny
byte-level model and 12 built-in prompts, then prints and writes one JSON of:
- trajectories: sha256 of every trajectory row (all columns), in prompt and block order;
- packed: sha256 of every packed row (all columns), and the packing figures;
- training: every step's losses and gradient norm (timings left out);
- evaluation: the table's deterministic columns (accuracy, TPF, exactness; no rates or seconds).

    python -m bench.behaviour_digest runs/digest --out bench/results/digest.json

Run it before and after a change, on the same host and versions, and compare the two files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq

from bench.tiny_model import make_tiny_model

TIMING = ("second", "tps", "speedup", "wall", "time", "elapsed")  # measured, so never equal twice


def recipe(root: Path) -> dict:
    return {
        "work_dir": str(root / "work"),
        "model": {"name_or_path": str(make_tiny_model(root / "model"))},
        "prompts": {"path": "builtin", "limit": 12, "shuffle_seed": 0, "chat_template": True},
        "trajectories": {"block_size": 4, "max_new_tokens": 16, "batch_size": 4},
        "prompts_per_shard": 6,
        "ray": {"num_workers": 1},
        "packing": {"strategy": "progressive", "window": 2},
        "training": {"max_steps": 6, "epochs": 10, "micro_batch_size": 2, "learning_rate": 1e-3, "checkpoint_every": 3},
        "launch": {"processes": 1, "threads_per_process": 1},
        # A short tune; the table leaves the tuned method out: a tune is measured, so it differs from run to run.
        "tuning": {"max_new_tokens": 16, "block_sizes": [1, 2, 4], "lookup_tokens": [0, 2], "curve_rounds": 1},
        "evaluation": {
            "benchmarks": [{"name": "gsm8k", "limit": 2, "seed": 0}, {"name": "humaneval", "limit": 2, "seed": 0}],
            "decoding": {
                "max_new_tokens": 16,
                "block_size": 4,
                "warmup_tokens": 2,
                "methods": ["hf_greedy", "jacobi", "multiblock"],
            },
            "unsafe_no_isolation": True,  # the table does not depend on isolation; this runs on any host
        },
        "registry": {"method": "multiblock"},
    }


def _row_digests(files: list[Path]) -> list[str]:
    digests = []
    for file in files:
        for row in pq.read_table(file).to_pylist():
            digests.append(hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:16])
    return digests


def _deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not any(t in k for t in TIMING)}


def digest(work: Path, table: list[dict]) -> dict:
    trajectories = sorted(work.glob("trajectories/*/shard-*.parquet"))
    packed_dirs = [p.parent for p in work.glob("packing/*/stats.json")]
    (packed,) = packed_dirs
    metrics = [json.loads(line) for line in next(work.glob("training/*/metrics.jsonl")).read_text().splitlines()]
    return {
        "trajectories": _row_digests(trajectories),
        "packed": _row_digests(sorted(packed.glob("*.parquet"))),
        "packing_stats": _deterministic(json.loads((packed / "stats.json").read_text())),
        "training": [_deterministic(m) for m in metrics],
        "evaluation": [_deterministic(r) for r in table],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a scratch folder (emptied first)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(parents=True)
    from flows.jacobi_forcing import jacobi_forcing

    result = jacobi_forcing(recipe(args.root))
    summary = digest(args.root / "work", result.evaluation.table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: (len(v) if isinstance(v, list) else v) for k, v in summary.items()}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
