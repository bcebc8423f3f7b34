"""The evaluation stage on the embedded SmolLM2, through a Prefect flow: one problem of each benchmark,
every default method (hf_greedy, jacobi, multiblock, tuned: this model has no tune, so its untuned default), and
every parallel-decoded output equal to greedy decoding (float32)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from prefect import flow
from prefect.artifacts import Artifact

from jfcore.config import from_dict
from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.evaluation.config import EvalConfig
from tasks import RESULTS_ARTIFACT
from tasks.evaluation import EvaluationResult, evaluation_task
from tasks.ray_workers import RayConfig

pytestmark = pytest.mark.slow

NAMES = ("humaneval", "mbpp", "gsm8k", "math500")


def test_smollm2_evaluation_is_lossless_and_reported(tmp_path):
    evaluation = {
        "output_dir": str(tmp_path),
        "models": {"base": {"model": {"name_or_path": "smollm2-135m-instruct"}}},
        "benchmarks": [{"name": name, "limit": 1, "seed": 3} for name in NAMES],
        "decoding": {"max_new_tokens": 32, "block_size": 16, "warmup_tokens": 8},  # 2 blocks
    }

    @flow(name="evaluate-smollm2")
    def evaluate_flow() -> EvaluationResult:
        # One torch thread: two threads on a host whose cores are busy wait on each other (10x slower here).
        config = from_dict(EvalConfig, evaluation, "evaluation")
        return evaluation_task(config, RayConfig(num_workers=1, cpus_per_worker=1))

    result = evaluate_flow()
    assert result.exact == {"equal": 16, "checked": 16}  # 4 problems x the project's 4 methods (ar, jacobi, ...)
    samples = pq.read_table(f"{result.report}/samples.parquet").to_pylist()
    expected_ids = {load_benchmark(BenchmarkConfig(name=name, limit=1, seed=3))[0].id for name in NAMES}
    assert {s["problem_id"] for s in samples} == expected_ids and len(samples) == 20
    assert all(s["exact"] and 0 < s["new_tokens"] <= 32 for s in samples)
    greedy = {s["problem_id"]: s["tokens"] for s in samples if s["method"] == "hf_greedy"}
    assert all(s["tokens"] == greedy[s["problem_id"]] for s in samples)
    artifact = Artifact.get(RESULTS_ARTIFACT)
    assert artifact is not None and artifact.data == result.markdown
