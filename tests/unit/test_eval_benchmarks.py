"""Benchmarks load from the shared copies with limits and seeds; references score 100% through Problem.score."""

from __future__ import annotations

import pytest

from jfcore.config import ConfigError, from_dict
from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark

SIZES = {"humaneval": 164, "mbpp": 257, "mbpp_full": 500, "gsm8k": 1319, "math500": 500}


@pytest.mark.parametrize("name", SIZES)
def test_every_benchmark_loads_whole_and_its_references_score(name):
    problems = load_benchmark(BenchmarkConfig(name=name))
    assert len(problems) == SIZES[name] and len({p.id for p in problems}) == SIZES[name]
    sample = load_benchmark(BenchmarkConfig(name=name, limit=20, seed=3))
    assert len(sample) == 20 and sample == load_benchmark(BenchmarkConfig(name=name, limit=20, seed=3))
    assert [p.id for p in sample] != [p.id for p in problems[:20]]  # the seed shuffles
    verdict = "passed" if sample[0].code else "correct"
    assert all(p.score(p.reference_completion()) == (True, verdict, verdict) for p in sample)
    assert not any(p.score("I am not sure.")[0] for p in sample)


def test_prompts_ask_for_the_format_the_scorer_reads():
    gsm8k = load_benchmark(BenchmarkConfig(name="gsm8k", limit=1))[0]
    assert gsm8k.prompt.endswith("within \\boxed{}.") and "Janet" in gsm8k.prompt
    humaneval = load_benchmark(BenchmarkConfig(name="humaneval", limit=1))[0]
    assert "```python\nfrom typing import List" in humaneval.prompt
    mbpp = load_benchmark(BenchmarkConfig(name="mbpp", limit=1))[0]
    assert "Your code should pass these tests:" in mbpp.prompt and "assert remove_Occ" in mbpp.prompt


def test_bad_inputs_get_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="'mmlu' is not one of"):
        from_dict(BenchmarkConfig, {"name": "mmlu"})
    with pytest.raises(FileNotFoundError, match="no file at .*missing.jsonl"):
        load_benchmark(BenchmarkConfig(name="gsm8k", path=str(tmp_path / "missing.jsonl")))
    wrong = tmp_path / "other.jsonl"
    wrong.write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError, match="no field 'question'"):
        load_benchmark(BenchmarkConfig(name="gsm8k", path=str(wrong)))
    with pytest.raises(FileNotFoundError, match="from the hub.*local file"):
        load_benchmark(BenchmarkConfig(name="gsm8k", path="nobody/no-such-dataset"))
