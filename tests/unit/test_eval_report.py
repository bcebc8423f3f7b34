"""The results table from hand-made sample rows: every column against a hand computation."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from jfcore.config import ConfigError, from_dict
from jfcore.evaluation.config import EvalConfig
from jfcore.evaluation.report import REPORT_FILES, markdown_table, summarize, write_report


def sample(benchmark, model, method, tokens, forwards, prefill, decode, correct, exact=True, verdict=None, ids=None):
    return {
        "tokens": list(range(tokens)) if ids is None else ids,  # fresh text unless given: no repeated 4-gram
        "benchmark": benchmark,
        "problem_id": "p",
        "model": model,
        "method": method,
        "new_tokens": tokens,
        "decode_forwards": forwards,
        "prefill_seconds": prefill,
        "decode_seconds": decode,
        "tpf": tokens / forwards,
        "correct": correct,
        "exact": exact,
        "verdict": verdict or ("passed" if correct else "failed"),
    }


SAMPLES = [
    # gsm8k: base greedy 10 + 30 tokens in 1+4 and 1+9 seconds; base jacobi the same tokens in half the decode time
    sample("gsm8k", "base", "hf_greedy", 10, 9, 1.0, 4.0, True),
    sample("gsm8k", "base", "hf_greedy", 30, 29, 1.0, 9.0, False),
    sample("gsm8k", "base", "jacobi", 10, 5, 1.0, 2.0, True),
    sample("gsm8k", "base", "jacobi", 30, 10, 1.0, 4.5, False, exact=False),
    sample("mbpp", "base", "hf_greedy", 20, 19, 1.0, 9.0, True),
    sample("mbpp", "base", "jacobi", 20, 4, 1.0, 1.5, True),
    sample("mbpp", "base", "jacobi", 20, 4, 1.0, 1.5, False, verdict="timeout"),  # ran out of CPU time
]


def row(table, benchmark, model, method):
    [match] = [r for r in table if (r["benchmark"], r["model"], r["method"]) == (benchmark, model, method)]
    return match


def test_every_column_is_computed_as_documented():
    table = summarize(SAMPLES, baseline="base")
    assert [(r["benchmark"], r["method"]) for r in table] == [
        ("gsm8k", "hf_greedy"),
        ("gsm8k", "jacobi"),
        ("mbpp", "hf_greedy"),
        ("mbpp", "jacobi"),
        ("all", "hf_greedy"),
        ("all", "jacobi"),
    ]
    greedy, jacobi = row(table, "gsm8k", "base", "hf_greedy"), row(table, "gsm8k", "base", "jacobi")
    assert greedy["samples"] == 2 and greedy["accuracy"] == 0.5
    assert greedy["tps"] == pytest.approx(40 / 15) and greedy["decode_tps"] == pytest.approx(40 / 13)
    assert greedy["speedup"] == pytest.approx(1.0)
    assert jacobi["tpf"] == pytest.approx((10 / 5 + 30 / 10) / 2)  # mean of per-sample TPF
    assert jacobi["tps"] == pytest.approx(40 / 8.5)
    assert jacobi["speedup"] == pytest.approx((40 / 8.5) / (40 / 15))
    assert jacobi["exact"] == 0.5
    pooled = row(table, "all", "base", "jacobi")
    assert pooled["samples"] == 4 and pooled["tps"] == pytest.approx(80 / 13.5)
    assert pooled["speedup"] == pytest.approx((80 / 13.5) / (60 / 25.0))
    # Timeouts are counted apart from wrong answers, per benchmark and method.
    assert [
        row(table, b, "base", m)["timeouts"] for b in ("gsm8k", "mbpp", "all") for m in ("hf_greedy", "jacobi")
    ] == [0, 0, 0, 1, 0, 1]
    assert row(table, "mbpp", "base", "jacobi")["accuracy"] == 0.5


def test_speedup_is_relative_to_the_baseline_model_on_the_same_benchmark():
    trained = [dict(s, model="trained") for s in SAMPLES if s["benchmark"] == "gsm8k"]
    table = summarize(SAMPLES[:4] + trained, baseline="base")
    assert row(table, "gsm8k", "trained", "hf_greedy")["speedup"] == pytest.approx(1.0)
    assert "all" not in {r["benchmark"] for r in table}  # one benchmark: no pooled rows
    without_baseline_greedy = [s for s in SAMPLES if not (s["model"] == "base" and s["method"] == "hf_greedy")]
    assert all(r["speedup"] is None for r in summarize(without_baseline_greedy, baseline="base"))


def test_speedup_vs_ar_is_over_the_same_models_own_ar_on_the_same_benchmark():
    """Each model's methods against its own `ar` (the project's engine, same kernels); none without one."""
    ar = [
        sample("gsm8k", "base", "ar", 40, 38, 2.0, 8.0, True),  # 40 tokens in 10 s
        sample("gsm8k", "trained", "ar", 40, 38, 1.0, 4.0, True),  # 40 tokens in 5 s
        sample("gsm8k", "trained", "jacobi", 40, 10, 1.0, 1.5, True),  # 40 tokens in 2.5 s
    ]
    table = summarize(SAMPLES + ar, baseline="base")
    assert row(table, "gsm8k", "base", "ar")["speedup_vs_ar"] == pytest.approx(1.0)
    assert row(table, "gsm8k", "base", "jacobi")["speedup_vs_ar"] == pytest.approx((40 / 8.5) / (40 / 10))
    assert row(table, "gsm8k", "base", "hf_greedy")["speedup_vs_ar"] == pytest.approx((40 / 15) / (40 / 10))
    assert row(table, "gsm8k", "trained", "jacobi")["speedup_vs_ar"] == pytest.approx(2.0)  # its own AR, not base's
    assert row(table, "gsm8k", "trained", "jacobi")["speedup"] == pytest.approx(16 / (40 / 15))
    assert row(table, "mbpp", "base", "jacobi")["speedup_vs_ar"] is None  # no AR measured there
    assert row(table, "all", "base", "jacobi")["speedup_vs_ar"] == pytest.approx((80 / 13.5) / (40 / 10))


def test_repetition_is_the_mean_share_of_tokens_closing_a_4gram_the_completion_held():
    loop = [5, 6, 7, 8] * 4  # 16 tokens, 13 4-grams: all but the first 4 close one seen before
    samples = [
        sample("gsm8k", "trained", "hf_greedy", 16, 15, 0.0, 1.0, False, ids=loop),
        sample("gsm8k", "trained", "hf_greedy", 16, 15, 0.0, 1.0, False),  # fresh text
    ]
    assert row(summarize(samples, "trained"), "gsm8k", "trained", "hf_greedy")["repetition"] == pytest.approx(
        (9 / 13 + 0) / 2
    )


def test_markdown_says_whether_every_output_equals_greedy():
    table = summarize(SAMPLES, baseline="base")
    text = markdown_table(table, SAMPLES, "base")
    assert "| vs own AR | vs base HF greedy | repeated 4-grams | = HF greedy |" in text
    assert "| gsm8k | base | jacobi | 2 | 50.0% | 0 | 2.50 | 4.7 | 6.2 | - | 1.76x | 0.0% | 50% |" in text
    assert "| mbpp | base | jacobi | 2 | 50.0% | 1 | 5.00 | 8.0 | 13.3 | - | 4.00x | 0.0% | 100% |" in text
    assert "3/4 outputs identical (NOT all: 1 differ)" in text
    exact = [dict(s, exact=True) for s in SAMPLES]
    assert "4/4 outputs identical (every one)" in markdown_table(summarize(exact, "base"), exact, "base")


def test_report_files(tmp_path):
    summary = write_report(tmp_path, SAMPLES, "base")
    for name in REPORT_FILES:
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "plots" / "speedup_vs_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "results.json").read_text())["exact"] == {"equal": 3, "checked": 4}
    assert pq.read_table(tmp_path / "results.parquet").num_rows == len(summary["table"]) == 6
    assert pq.read_table(tmp_path / "samples.parquet").num_rows == len(SAMPLES)


BASE = {"output_dir": "out", "models": {"base": {"model": {"name_or_path": "m"}}}, "benchmarks": [{"name": "gsm8k"}]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"benchmarks": [{"name": "gsm8kk"}]}, "evaluation.benchmarks[0].name: 'gsm8kk' is not one of 'humaneval'"),
        ({"baseline": "ar"}, "evaluation: EvalConfig.baseline: 'ar' is not one of the models (base)"),
        ({"decoding": {"methods": ["jacobi"]}}, "decoding.methods: must include 'hf_greedy'"),
        ({"decoding": {"methods": ["hf_greedy", "lookahead"]}}, "'lookahead' is not one of"),
        (
            {"models": {"base": {"model": {"name_or_path": "m"}, "uri": "x"}}},
            "evaluation.models.base: unknown key 'uri'",
        ),
        ({"benchmarks": [{"name": "gsm8k"}, {"name": "gsm8k"}]}, "a benchmark is listed twice"),
        ({"benchmarks": [{"name": "gsm8k", "limit": 0}]}, "limit: must be >= 1"),
        ({"decoding": {"max_new_tokens": -1}}, "max_new_tokens: must be >= 1"),
    ],
)
def test_bad_recipes_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        from_dict(EvalConfig, BASE | change, "evaluation")


def test_markdown_gives_each_timed_methods_ratio_to_the_baseline_model_round_by_round():
    # Both models decode 40 tokens per problem; per round, base takes 4 + 4 s and trained 2 + 3, 4 + 1, 1 + 1 s.
    base = [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
    trained = [[2.0, 4.0, 1.0], [3.0, 1.0, 1.0]]
    samples = [
        dict(sample("gsm8k", model, "tuned", 40, 20, 0.0, rounds[0], True), round_seconds=rounds)
        for model, seconds in (("base", base), ("trained", trained))
        for rounds in seconds
    ]
    samples += [sample("gsm8k", model, "hf_greedy", 40, 39, 0.0, 10.0, True) for model in ("base", "trained")]
    text = markdown_table(summarize(samples, "base"), samples, "base")
    assert (
        "- gsm8k, tuned: trained over base in each of 3 interleaved rounds 1.600, 1.600, 4.000 (median 1.600x)" in text
    )
    assert "hf_greedy: trained" not in text  # one round: no ratio line
