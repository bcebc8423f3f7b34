"""Trajectory generation throughput: {1, 2} Ray workers x {batched, unbatched}, in ONE interleaved run.

Every configuration runs `tasks.trajectories.generate_trajectories` end to end (Ray started and stopped
by it, a fresh output folder each time) on the same prompts; the order of the configurations rotates
from one round to the next. The host's cores are split evenly between the workers. Rates are on the
generation time (from the "workers ready" log line to the last shard); the wall time adds the one-off
costs (Ray start, model loading in the actors, Ray shutdown). See docs/BENCHMARKS.md.

    python -m bench.trajectory_bench --limit 8 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.parquet as pq
import ray
import transformers

from bench.common import RESULTS, environment
from jfcore.contracts import Selection
from jfcore.models import ModelConfig
from jfcore.prompts import PromptSource
from jfcore.trajectories import TrajectoryConfig
from tasks.trajectories import RayConfig, generate_trajectories


@dataclass(frozen=True)
class Config:
    workers: int
    threads: int  # torch threads (= Ray CPUs) per worker
    batch_size: int

    @property
    def name(self) -> str:
        return f"{self.workers}w x {self.threads}t, batch {self.batch_size}"


def run_config(
    config: Config, model: ModelConfig, source: PromptSource, trajectory: TrajectoryConfig, prompts_per_shard: int, log
) -> tuple[dict, dict]:
    """One end-to-end `generate_trajectories`; returns its record and its rows {(prompt_id, block): row}."""
    marks: dict[str, float] = {}
    pids: list[int] = []
    cpu: dict[str, tuple[float, float]] = {}

    def on_log(line: str) -> None:
        now = time.perf_counter()
        if "workers ready" in line:
            marks["ready"] = now
            pids.extend(int(p) for p in re.findall(r"\d+", line.partition("pids")[2]))
            cpu["ready"] = cpu_seconds(pids)
        elif m := re.match(r"shard (\d+)/(\d+) done", line):
            marks["end"] = now  # the last one wins
            if m[1] == m[2]:
                cpu["end"] = cpu_seconds(pids)  # the actors are still alive here
        log(f"  [{config.name}] {line}")

    with tempfile.TemporaryDirectory(prefix="trajectory-bench-") as out_dir:
        start = time.perf_counter()
        folder = generate_trajectories(
            model,
            source,
            TrajectoryConfig(**{**asdict(trajectory), "batch_size": config.batch_size}),
            RayConfig(num_workers=config.workers, cpus_per_worker=config.threads),
            out_dir,
            prompts_per_shard,
            on_log,
        )
        wall = time.perf_counter() - start
        wait_for_exit(pids)  # ray.shutdown() does not wait for the actors: keep them out of the next run
        selection = Selection.read(folder)  # the prompt set's rows: which shard of the store holds which prompt
        assert selection.complete and selection.decoded == selection.num_prompts, f"{folder}: not all decoded"
        columns = ["prompt_id", "block_index", "fixed_point", "states"]
        rows, count = {}, 0
        for path, ids in selection.files().items():
            wanted = set(ids)
            for r in pq.read_table(path, columns=columns).to_pylist():
                if r["prompt_id"] in wanted:
                    rows[(r["prompt_id"], r["block_index"])] = r
                    count += 1
    assert len(rows) == count, "duplicate (prompt_id, block) rows"
    generation = marks["end"] - marks["ready"]
    (host0, own0), (host1, own1) = cpu["ready"], cpu["end"]
    other = (host1 - host0) - (own1 - own0)  # CPU seconds of everything but the actors and this process
    tokens = sum(len(r["fixed_point"]) for r in rows.values())
    record = {
        **asdict(config),
        "name": config.name,
        "prompts": selection.num_prompts,
        "rows": len(rows),
        "tokens": tokens,
        "wall_seconds": wall,
        "setup_seconds": marks["ready"] - start,
        "generation_seconds": generation,
        "other_cpu_share": other / (generation * (os.cpu_count() or 1)),
    }
    return record, rows


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """Busy CPU seconds of the whole host, and CPU seconds of `pids` and this process (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    own = 0
    for pid in [*pids, os.getpid()]:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        own += int(stat[11]) + int(stat[12])  # utime, stime
    return (sum(fields) - fields[3] - fields[4]) / tick, own / tick  # busy = all but idle and iowait


def wait_for_exit(pids: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)


def compare(rows: dict, reference: dict) -> dict:
    """Rows whose fixed point (or, separately, whose intermediate states) differ from the reference run."""
    keys = rows.keys() | reference.keys()
    missing = [k for k in keys if k not in rows or k not in reference]
    both = [k for k in keys if k in rows and k in reference]
    return {
        "rows": len(keys),
        "missing_or_extra": len(missing),
        "fixed_point_differs": len(missing) + sum(rows[k]["fixed_point"] != reference[k]["fixed_point"] for k in both),
        "states_differ": len(missing) + sum(rows[k]["states"] != reference[k]["states"] for k in both),
        "initial_draft_differs": len(missing) + sum(rows[k]["states"][0] != reference[k]["states"][0] for k in both),
        "prompts_affected": len(
            {k[0] for k in missing} | {k[0] for k in both if rows[k]["fixed_point"] != reference[k]["fixed_point"]}
        ),
    }


def aggregate(runs: list[dict], configs: list[Config]) -> dict[str, dict]:
    """Per configuration over all rounds: sums, and rates as ratios of sums."""
    out = {}
    for c in configs:
        mine = [r for r in runs if r["name"] == c.name]
        total = {
            k: sum(r[k] for r in mine)
            for k in ("prompts", "rows", "tokens", "wall_seconds", "setup_seconds", "generation_seconds")
        }
        out[c.name] = {
            **asdict(c),
            "runs": len(mine),
            **total,
            "prompts_per_s": total["prompts"] / total["generation_seconds"],
            "tokens_per_s": total["tokens"] / total["generation_seconds"],
            "wall_tokens_per_s": total["tokens"] / total["wall_seconds"],
            "other_cpu_share": sum(r["other_cpu_share"] * r["generation_seconds"] for r in mine)
            / total["generation_seconds"],
        }
    return out


def ratios(agg: dict, configs: list[Config]) -> dict[str, dict]:
    """Speedups in tokens/s and prompts/s (generation time) and in wall time."""
    by = {(c.workers, c.batch_size): agg[c.name] for c in configs}
    workers = sorted({c.workers for c in configs})
    batches = sorted({c.batch_size for c in configs}, reverse=True)

    def ratio(a: dict, b: dict) -> dict:
        return {
            "tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
            "prompts_per_s": a["prompts_per_s"] / b["prompts_per_s"],
            "wall": b["wall_seconds"] / a["wall_seconds"],
        }

    out = {}
    for b in batches:
        out[f"{workers[-1]} vs {workers[0]} workers, batch {b}"] = ratio(by[workers[-1], b], by[workers[0], b])
    for w in workers:
        out[f"batch {batches[0]} vs {batches[-1]}, {w} worker(s)"] = ratio(by[w, batches[0]], by[w, batches[-1]])
    return out


def format_table(agg: dict, speedups: dict) -> str:
    header = (
        f"{'configuration':<24}{'workers':>8}{'thr/w':>6}{'batch':>6}{'prompts':>8}{'rows':>6}{'tokens':>8}"
        f"{'wall s':>8}{'gen s':>8}{'prompts/s':>10}{'tokens/s':>10}{'other CPU':>11}"
    )
    lines = [header]
    for name, a in agg.items():
        lines.append(
            f"{name:<24}{a['workers']:>8}{a['threads']:>6}{a['batch_size']:>6}{a['prompts']:>8}"
            f"{a['rows']:>6}{a['tokens']:>8}{a['wall_seconds']:>8.1f}{a['generation_seconds']:>8.1f}"
            f"{a['prompts_per_s']:>10.3f}{a['tokens_per_s']:>10.1f}{a['other_cpu_share']:>11.0%}"
        )
    lines += ["", f"{'speedup':<32}{'tokens/s':>9}{'prompts/s':>10}{'wall':>7}"]
    for name, r in speedups.items():
        lines.append(f"{name:<32}{r['tokens_per_s']:>8.2f}x{r['prompts_per_s']:>9.2f}x{r['wall']:>6.2f}x")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=ModelConfig().name_or_path, help="preset, checkpoint dir, .gguf file or hub id")
    p.add_argument("--prompts", default="builtin", help="'builtin' or a JSONL/Parquet path")
    p.add_argument("--field", default="prompt", help="field of --prompts holding the text")
    p.add_argument("--limit", type=int, default=32, help="prompts (default 32)")
    p.add_argument("--shuffle-seed", type=int, default=0, help="shuffle before --limit (0: code and math mix)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="B of the batched configurations (default 8)")
    p.add_argument("--prompts-per-shard", type=int, default=8)
    p.add_argument("--workers", default="1,2", help="worker counts, comma-separated (default 1,2)")
    p.add_argument("--cpus", type=int, default=os.cpu_count(), help="cores split between the workers (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="rounds; the configuration order rotates per round")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/trajectories_<model>_cpu.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)
    model = ModelConfig(name_or_path=args.model)
    source = PromptSource(path=args.prompts, field=args.field, limit=args.limit, shuffle_seed=args.shuffle_seed)
    trajectory = TrajectoryConfig(
        block_size=args.block_size, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
    )
    workers = [int(w) for w in args.workers.split(",") if w]
    configs = [Config(w, max(1, args.cpus // w), b) for b in (args.batch_size, 1) for w in workers]
    print(
        f"{args.model} float32 on CPU, {args.cpus} cores split evenly (threads per worker = cores // workers): "
        f"{args.limit} prompts from {args.prompts}, block {args.block_size}, {args.max_new_tokens} new tokens, "
        f"{args.prompts_per_shard} prompts per shard, {args.repeats} round(s) of: "
        + "; ".join(c.name for c in configs),
        flush=True,
    )

    runs, rows_of = [], {}
    for r in range(args.repeats):
        for c in configs[r % len(configs) :] + configs[: r % len(configs)]:
            record, rows = run_config(c, model, source, trajectory, args.prompts_per_shard, log)
            runs.append({"round": r, **record})
            rows_of[(c.name, r)] = rows
            log(
                f"round {r + 1}/{args.repeats} {c.name}: {record['generation_seconds']:.1f} s generation, "
                f"{record['wall_seconds']:.1f} s wall, {record['tokens']} tokens, "
                f"other CPU {record['other_cpu_share']:.0%}"
            )

    # reference: the simplest setup (fewest workers, no batching), first round
    reference = (next(c.name for c in configs if c.batch_size == 1 and c.workers == min(workers)), 0)
    consistency = {f"{name} round {r}": compare(rows, rows_of[reference]) for (name, r), rows in rows_of.items()}
    agg = aggregate(runs, configs)
    speedups = ratios(agg, configs)
    print("\n" + format_table(agg, speedups))
    print(f"\nsame rows (prompt_id, block_index, fixed_point) as '{reference[0]}' round 0:")
    for name, c in consistency.items():
        verdict = (
            "identical"
            if c["fixed_point_differs"] == 0
            else (f"{c['fixed_point_differs']} of {c['rows']} rows DIFFER ({c['prompts_affected']} prompts)")
        )
        print(
            f"  {name:<34}{verdict}; states differ in {c['states_differ']} rows "
            f"(initial draft in {c['initial_draft_differs']})"
        )
    if any(c["states_differ"] for c in consistency.values()):
        print(
            "  (the context filler of initial drafts comes from one RNG per decode call, shared by the rows of a "
            "batch,\n   so states depend on batch size and composition; fixed points must not)"
        )

    tag = re.sub(r"[^\w.-]+", "-", Path(args.model.rstrip("/")).name)
    out = args.out or RESULTS / f"trajectories_{tag}_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    env = {k: v for k, v in environment(model).items() if k != "torch_threads"}  # the driver's: see configurations
    record = {
        "settings": settings,
        "environment": env | {"ray": ray.__version__},
        "configurations": [asdict(c) | {"name": c.name} for c in configs],
        "runs": runs,
        "aggregates": agg,
        "speedups": speedups,
        "reference": f"{reference[0]} round 0",
        "consistency": consistency,
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    sys.exit(main())
