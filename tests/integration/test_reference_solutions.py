"""Every reference solution of the code benchmarks (921 programs, the shared real data) passes in the sandbox."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.evaluation.code import judge_workers, score_completion


@pytest.mark.parametrize("name, count", [("humaneval", 164), ("mbpp", 257), ("mbpp_full", 500)])
def test_every_reference_solution_passes(name, count):
    problems = [p.code for p in load_benchmark(BenchmarkConfig(name=name))]
    assert len(problems) == count
    with ThreadPoolExecutor(judge_workers()) as pool:
        verdicts = list(pool.map(lambda p: score_completion(p, p.reference), problems))
    assert [(p.task_id, v.detail) for p, v in zip(problems, verdicts) if not v.passed] == []
