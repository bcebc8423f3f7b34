"""Data-path scaling: packing and training-data loading on synthetic trajectory sets of S and 10xS prompts.

Each prompt has 8 blocks, and its blocks are spread over every shard (block j of a prompt lands in shard
(j + prompt) mod shards), so no shard can be packed alone. Every phase runs in a fresh process, which
reports its peak RSS and wall time:

- `pack`: `jfcore.packing.pack_shards` (streaming, bounded memory);
- `load`: `PackedData` on the packed folder, then every row taken in micro batches of 8, in a seeded order;
- `pack_in_memory` and `load_in_memory` (with `--previous`): the implementations this replaced (every row
  as Python objects), for contrast.

    python -m bench.data_scale_bench --prompts 2000          # S = 2,000 and 10xS = 20,000 prompts

It prints the 10xS / S ratios (the bar: peak RSS within 1.5x, time within 12x) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench.common import RESULTS

BLOCKS, BLOCK_SIZE, STATES, SHARDS = 8, 16, 3, 8


def synthetic_set(folder: Path, prompts: int, seed: int = 0) -> list[Path]:
    """Valid trajectory shards: each block's states converge to its fixed point; contexts chain."""
    from jfcore.trajectories import first_mismatch, rows_to_table

    rng = random.Random(seed)
    shards: list[list[dict]] = [[] for _ in range(SHARDS)]
    for p in range(prompts):
        prompt = [rng.randrange(1, 30000) for _ in range(rng.randrange(20, 60))]
        context = list(prompt)
        for j in range(BLOCKS):
            fixed = [rng.randrange(1, 30000) for _ in range(BLOCK_SIZE)]
            states = [[*fixed[:k], *(rng.randrange(1, 30000) for _ in range(BLOCK_SIZE - k))] for k in (0, 5, 11)]
            row = {
                "prompt_id": f"p{p:07d}",
                "block_index": j,
                "block_size": BLOCK_SIZE,
                "prompt_length": len(prompt),
                "context": list(context),
                "states": [*states[: STATES - 1], fixed],
                "first_mismatch": [first_mismatch(s, fixed) for s in [*states[: STATES - 1], fixed]],
                "fixed_point": fixed,
                "last_block": j == BLOCKS - 1,
                "model_fingerprint": "synthetic",
                "tokenizer_fingerprint": "synthetic",
            }
            shards[(j + p) % SHARDS].append(row)
            context += fixed
    files = []
    folder.mkdir(parents=True, exist_ok=True)
    for s, rows in enumerate(shards):
        path = folder / f"shard-{s:05d}.parquet"
        pq.write_table(rows_to_table(rows), path)
        files.append(path)
    return files


def phase(name: str, source: Path, packed: Path) -> dict:
    """Run one phase in this process; return its wall seconds and peak RSS."""
    from jfcore.packing import PackingConfig, pack_shards
    from jfcore.training.data import DataOrder, PackedData

    baseline = _status_mb("VmRSS")  # the interpreter and its imports (torch among them), before any data is touched
    start = time.perf_counter()
    if name == "pack":
        pack_shards([source], packed, PackingConfig())
    elif name == "load":
        data = PackedData(packed)
        order = DataOrder(len(data), micro_batch=8, world_size=1, accumulation=1, seed=0)
        for step in range(order.steps_per_epoch):
            data.take(order.rows(step, 0, 0))
    elif name == "pack_in_memory":
        from tests.support.packing_reference import pack_in_memory

        pack_in_memory(sorted(source.glob("*.parquet")), PackingConfig())
    elif name == "load_in_memory":
        stats = json.loads((packed / "stats.json").read_text())
        rows = [r for shard in stats["shards"] for r in pq.read_table(packed / shard).to_pylist()]
        order = np.random.default_rng(0).permutation(len(rows))
        for i in range(0, len(rows) - 7, 8):
            [rows[j] for j in order[i : i + 8]]
    seconds = time.perf_counter() - start
    peak = _status_mb("VmHWM")  # this process image's own peak (ru_maxrss would carry the parent's across exec)
    return {"seconds": seconds, "peak_rss_mb": peak, "baseline_rss_mb": baseline, "data_rss_mb": peak - baseline}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_phase(name: str, source: Path, packed: Path) -> dict:
    command = [sys.executable, "-m", "bench.data_scale_bench", "--phase", name, str(source), str(packed)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=2000, help="S: prompts of the smaller set (the larger has 10x)")
    p.add_argument("--previous", action="store_true", help="also measure the in-memory implementations")
    p.add_argument("--work", type=Path, help="where the sets go (default: a temporary folder)")
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/data-scale-<time>.json)")
    p.add_argument("--phase", nargs=3, metavar=("NAME", "SOURCE", "PACKED"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase:
        name, source, packed = args.phase
        print(json.dumps(phase(name, Path(source), Path(packed))))
        return 0

    work = args.work or Path(tempfile.mkdtemp(prefix="jf-data-scale-"))
    phases = ["pack", "load"] + (["pack_in_memory", "load_in_memory"] if args.previous else [])
    results: dict[str, dict] = {}
    for label, prompts in (("S", args.prompts), ("10xS", 10 * args.prompts)):
        source, packed = work / f"{label}-trajectories", work / f"{label}-packed"
        started = time.perf_counter()
        files = synthetic_set(source, prompts)
        size = sum(f.stat().st_size for f in files) / 2**20
        print(
            f"{label}: {prompts} prompts, {prompts * BLOCKS} rows, {size:.0f} MB of Parquet over {len(files)} "
            f"shards (made in {time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        results[label] = {"prompts": prompts, "rows": prompts * BLOCKS, "parquet_mb": size}
        for name in phases:
            results[label][name] = run_phase(name, source, packed)
            r = results[label][name]
            print(
                f"  {name:<15} {r['seconds']:7.1f} s   peak RSS {r['peak_rss_mb']:6.0f} MB "
                f"({r['data_rss_mb']:5.0f} MB above the {r['baseline_rss_mb']:.0f} MB of imports)",
                flush=True,
            )
    ratios = {
        name: {
            "rss": results["10xS"][name]["peak_rss_mb"] / results["S"][name]["peak_rss_mb"],
            "time": results["10xS"][name]["seconds"] / results["S"][name]["seconds"],
            "data_rss": results["10xS"][name]["data_rss_mb"] / max(results["S"][name]["data_rss_mb"], 1.0),
        }
        for name in phases
    }
    print("\n10xS / S:")
    for name, r in ratios.items():
        verdict = "" if name.endswith("in_memory") else ("  ok" if r["rss"] <= 1.5 and r["time"] <= 12 else "  OVER")
        print(
            f"  {name:<15} peak RSS {r['rss']:.2f}x (above imports {r['data_rss']:.2f}x)   time {r['time']:.2f}x{verdict}"
        )
    out = args.out or RESULTS / f"data-scale-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    host = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    out.write_text(json.dumps({"results": results, "ratios": ratios, "host": host}, indent=2))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
