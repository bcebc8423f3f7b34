"""How much CPU time the code benchmarks' reference solutions need in the sandbox: the basis of their budgets.

    python -m bench.sandbox_budget                # every reference of humaneval, mbpp, mbpp_full
    python -m bench.sandbox_budget --benchmarks mbpp --top 10

Each reference solution is judged by its benchmark's tests through the same path a
model's completion takes, with a budget far above any of them, and the sandbox
process's CPU seconds are recorded. Printed per benchmark: the slowest solutions,
this host's slowdown factor (`jfcore.hostspeed`), and the slowest solution in
reference-machine seconds next to the budget `jfcore.evaluation.code.CPU_BUDGET_S` gives
it. Writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.evaluation.code import CPU_BUDGET_S, judge_workers, score_completion
from jfcore.evaluation.sandbox import SandboxLimits
from jfcore.hostspeed import slowdown

GENEROUS = SandboxLimits(cpu_s=120, wall_s=600)


def measure(name: str) -> list[dict]:
    problems = [p.code for p in load_benchmark(BenchmarkConfig(name=name))]

    def one(problem):
        start = time.perf_counter()
        verdict = score_completion(problem, problem.reference, GENEROUS)
        return {
            "task_id": problem.task_id,
            "status": verdict.status,
            "cpu_seconds": verdict.cpu_seconds,
            "wall_seconds": time.perf_counter() - start,
        }

    with ThreadPoolExecutor(judge_workers()) as pool:
        return list(pool.map(one, problems))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmarks", nargs="+", default=list(CPU_BUDGET_S), choices=list(CPU_BUDGET_S))
    parser.add_argument("--top", type=int, default=5, help="slowest solutions to print per benchmark")
    parser.add_argument("--out", default="bench/results/sandbox_budget.json")
    args = parser.parse_args(argv)

    factor = slowdown()
    print(
        f"host slowdown vs the reference machine: {factor:.2f} (jfcore.hostspeed); judges in parallel: {judge_workers()}"
    )
    results = {
        "host": {
            "machine": platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "slowdown": factor,
        },
        "benchmarks": {},
    }
    for name in args.benchmarks:
        rows = sorted(measure(name), key=lambda r: -r["cpu_seconds"])
        failed = [r for r in rows if r["status"] != "passed"]
        slowest = rows[0]["cpu_seconds"]
        print(
            f"\n{name}: {len(rows)} references, {len(failed)} not passed; slowest {slowest:.2f} s CPU here "
            f"= {slowest / factor:.2f} s on the reference machine; budget {CPU_BUDGET_S[name]:g} s "
            f"({CPU_BUDGET_S[name] * factor / slowest:.1f}x the slowest here)"
        )
        for r in rows[: args.top]:
            print(
                f"  {r['task_id']:>16}  {r['cpu_seconds']:6.2f} s CPU  {r['wall_seconds']:6.2f} s wall  {r['status']}"
            )
        for r in failed:
            print(f"  NOT PASSED: {r['task_id']} {r['status']}")
        results["benchmarks"][name] = {
            "budget_cpu_s": CPU_BUDGET_S[name],
            "slowest_cpu_s": slowest,
            "failed": [r["task_id"] for r in failed],
            "rows": rows,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
