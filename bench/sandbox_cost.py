"""What operating-system isolation costs per judged program, measured side by side.

    python -m bench.sandbox_cost                          # HumanEval's 164 references
    python -m bench.sandbox_cost --benchmark mbpp --repeats 1

Every reference solution is judged through the same path a model's completion takes,
once isolated (bubblewrap namespaces, `jfcore.evaluation.isolation`) and once unisolated (the
plain child process, guarded only by the audit hook), alternating program by program so
that a host slowing down hits both alike. Printed: milliseconds per judged program for
each (one judge at a time), their ratio, and the wall time of judging every reference
with `judge_workers()` judges at once. Writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.evaluation.code import CPU_BUDGET_S, judge_workers, score_completion

MODES = {"isolated": True, "unisolated": False}


def timed(problem, isolated: bool) -> float:
    start = time.perf_counter()
    verdict = score_completion(problem, problem.reference, isolated=isolated)
    if not verdict.passed:
        raise SystemExit(f"{problem.task_id}: the reference did not pass ({verdict.status}: {verdict.detail})")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark", default="humaneval", choices=list(CPU_BUDGET_S))
    parser.add_argument("--repeats", type=int, default=2, help="passes over the references, one judge at a time")
    parser.add_argument("--out", default="bench/results/sandbox_cost.json")
    args = parser.parse_args(argv)

    problems = [p.code for p in load_benchmark(BenchmarkConfig(name=args.benchmark))]
    per_program: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(args.repeats):
        for j, problem in enumerate(problems):
            order = list(MODES) if (i + j) % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                per_program[mode].append(timed(problem, MODES[mode]))
    workers = judge_workers()
    wall = {}
    for mode, isolated in MODES.items():
        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda p: timed(p, isolated), problems))  # noqa: B023 (used before the loop moves on)
        wall[mode] = time.perf_counter() - start
    ms = {mode: 1000 * statistics.median(times) for mode, times in per_program.items()}
    mean_ms = {mode: 1000 * statistics.fmean(times) for mode, times in per_program.items()}
    print(f"{args.benchmark}: {len(problems)} references x {args.repeats} passes, one judge at a time")
    for mode in MODES:
        print(
            f"  {mode:>10}: {ms[mode]:6.1f} ms per program (median), {mean_ms[mode]:6.1f} ms (mean); "
            f"all {len(problems)} with {workers} judges at once: {wall[mode]:.1f} s wall"
        )
    print(
        f"  isolated / unisolated: {ms['isolated'] / ms['unisolated']:.2f}x per program (median), "
        f"+{ms['isolated'] - ms['unisolated']:.1f} ms; {wall['isolated'] / wall['unisolated']:.2f}x wall for all"
    )
    result = {
        "benchmark": args.benchmark,
        "references": len(problems),
        "repeats": args.repeats,
        "judges": workers,
        "median_ms": ms,
        "mean_ms": mean_ms,
        "wall_all_s": wall,
        "host": {"machine": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
