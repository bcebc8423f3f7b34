"""The registry gate judges what training added: the trained model's tuned decoding against the base model's (or the
champion's) tuned decoding, round by round, and an evaluation times that method in repeated interleaved rounds."""

from __future__ import annotations

import pytest

from jfcore.config import ConfigError, from_dict
from jfcore.evaluation.benchmarks import Problem
from jfcore.evaluation.config import DecodingSettings, EvalModel
from jfcore.evaluation.report import summarize
from jfcore.evaluation.runner import Evaluator, load_models
from jfcore.models import ModelConfig
from tasks.registry import GateConfig, decide
from tests.support.tiny_models import save_tiny_checkpoint


def rows(
    model: str, method: str, tokens: int, round_seconds: list[list[float]], solved: list[bool], loop: int = 0
) -> list[dict]:
    """One sample per problem: `round_seconds[p]` is problem p's seconds per timing round (prefill 0); the text is
    fresh, or with `loop` a loop of that many distinct tokens."""
    return [
        {
            "tokens": [t % loop for t in range(tokens)] if loop else list(range(tokens)),
            "benchmark": "gsm8k",
            "problem_id": f"p{p}",
            "model": model,
            "method": method,
            "new_tokens": tokens,
            "decode_forwards": tokens,
            "prefill_seconds": 0.0,
            "decode_seconds": seconds[0],
            "round_seconds": seconds,
            "tpf": 1.0,
            "correct": ok,
            "exact": True,
            "verdict": "correct" if ok else "wrong",
        }
        for p, (seconds, ok) in enumerate(zip(round_seconds, solved))
    ]


def table(trained_rounds, base_rounds, trained_solved=(True, False), base_solved=(True, False)) -> list[dict]:
    samples = rows("base", "hf_greedy", 10, [[2.0], [2.0]], list(base_solved))
    samples += rows("base", "tuned", 10, base_rounds, list(base_solved))
    samples += rows("trained", "hf_greedy", 10, [[2.0], [2.0]], list(trained_solved))
    samples += rows("trained", "tuned", 10, trained_rounds, list(trained_solved))
    return summarize(samples, baseline="base")


def test_the_bar_is_the_base_models_tuned_decoding_and_every_round_must_gain():
    # Base tuned: 1.0 s per problem in each of 3 rounds; trained tuned 0.8, 0.9, 0.95: faster in every round.
    t = table([[0.8, 0.9, 0.95]] * 2, [[1.0, 1.0, 1.0]] * 2)
    passed, reason = decide(t, GateConfig(), None, float32=True)
    assert passed, reason
    assert "tuned vs the base model's tuned" in reason
    assert "median of 3 interleaved rounds, spread 1.053x-1.250x" in reason and "speed 1.111x" in reason
    # The first round against the base model's HF greedy (2 s per problem): base tuned 2x, trained 2.5x.
    assert "2.50x vs 2.00x the base model's HF greedy" in reason
    # A gain in two rounds and a loss in the third is inside the noise: not promoted.
    passed, reason = decide(table([[0.8, 0.9, 1.05]] * 2, [[1.0, 1.0, 1.0]] * 2), GateConfig(), None, True)
    assert not passed and reason.startswith("not faster: ") and "spread 0.952x-1.250x" in reason
    # min_speedup_gain raises the bar every round must clear.
    t = table([[0.8, 0.9, 0.95]] * 2, [[1.0, 1.0, 1.0]] * 2)
    assert not decide(t, GateConfig(min_speedup_gain=0.1), None, True)[0]
    assert decide(t, GateConfig(min_speedup_gain=0.05), None, True)[0]


def test_a_faster_base_tune_is_the_bar_not_base_greedy():
    # Trained tuned is twice HF greedy's speed, but the base model's tune is faster still: training added nothing.
    t = table([[1.0, 1.0, 1.0]] * 2, [[0.9, 0.9, 0.9]] * 2)
    passed, reason = decide(t, GateConfig(), None, True)
    assert not passed and "not faster" in reason and "speed 0.900x" in reason


def test_accuracy_and_a_single_round_and_the_champion():
    t = table([[0.5, 0.5, 0.5]] * 2, [[1.0, 1.0, 1.0]] * 2, trained_solved=(False, False))
    passed, reason = decide(t, GateConfig(), None, True)
    assert not passed and reason.startswith("accuracy fell too far: ") and "solved 0/2 vs 1/2" in reason
    assert decide(t, GateConfig(max_accuracy_drop_problems=1), None, True)[0]
    # One timing round measures no spread: the gate refuses to judge speed and says what to set.
    t = table([[0.5]] * 2, [[1.0]] * 2)
    passed, reason = decide(t, GateConfig(), None, True)
    assert not passed and "the gate needs 3 (evaluation.decoding.timing_rounds)" in reason
    # With a champion, the bar is the champion's rows under the same method.
    samples = rows("base", "hf_greedy", 10, [[2.0], [2.0]], [True, False])
    samples += rows("champion", "tuned", 10, [[0.4, 0.4, 0.4]] * 2, [True, False])
    samples += rows("trained", "tuned", 10, [[0.5, 0.5, 0.5]] * 2, [True, False])
    passed, reason = decide(summarize(samples, "base"), GateConfig(), "v3", True)
    assert not passed and "vs champion v3's tuned" in reason and "speed 0.800x" in reason


def test_a_model_whose_text_repeats_itself_more_than_the_bars_is_not_promoted():
    faster = [[0.5, 0.5, 0.5]] * 2
    samples = rows("base", "hf_greedy", 10, [[2.0], [2.0]], [True, False])
    samples += rows("base", "tuned", 10, [[1.0, 1.0, 1.0]] * 2, [True, False])
    samples += rows("trained", "tuned", 10, faster, [True, False], loop=2)  # 2-token loops: 5 of 7 4-grams repeat
    t = summarize(samples, "base")
    passed, reason = decide(t, GateConfig(), None, True)
    assert not passed and reason.startswith("repeats itself more: ")
    assert "repeated 4-grams 71.4% vs 0.0% (allowed rise 10.0 points)" in reason
    assert decide(t, GateConfig(max_repetition_gain=0.9), None, True)[0]
    assert decide(t, GateConfig(max_repetition_gain=None), None, True)[0]
    # A table made before repetition was measured cannot show it: refused unless the check is off.
    old = [{k: v for k, v in row.items() if k != "repetition"} for row in t]
    passed, reason = decide(old, GateConfig(), None, True)
    assert not passed and reason.startswith("repetition unmeasured: ") and "the evaluation predates it" in reason
    assert decide(old, GateConfig(max_repetition_gain=None), None, True)[0]
    with pytest.raises(ConfigError, match="gate.max_repetition_gain: must be >= 0"):
        from_dict(GateConfig, {"max_repetition_gain": -0.1}, "registry")


def test_gate_config_needs_rounds_for_a_spread():
    with pytest.raises(ConfigError, match="gate.rounds: the spread needs >= 2 timing rounds, got 1"):
        from_dict(GateConfig, {"rounds": 1}, "registry")
    with pytest.raises(ConfigError, match=r"decoding.timed_methods: \['tuned'\] are not in decoding.methods"):
        DecodingSettings(methods=("hf_greedy", "ar"), timing_rounds=3)


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")
    settings = DecodingSettings(
        methods=("hf_greedy", "ar", "jacobi"),
        max_new_tokens=8,
        block_size=4,
        warmup_tokens=0,
        timing_rounds=3,
        timed_methods=("ar",),
    )
    model = EvalModel(model=ModelConfig(name_or_path=str(folder), dtype="float32", device="cpu"))
    return Evaluator(load_models({"base": model, "trained": model}, settings), settings)


PROBLEMS = [Problem("gsm8k", f"p{i}", f"w{i} w{i + 7} w{i + 3}", "1") for i in range(2)]


def test_timed_methods_decode_every_round_interleaved_and_reproduce_their_tokens(evaluator):
    calls = []
    for label, model in evaluator.models.items():
        for method, run in list(model.methods.items()):
            model.methods[method] = lambda p, n, run=run, pair=(label, method): calls.append(pair) or run(p, n)
    out = evaluator.run(PROBLEMS)
    rounds = {(r["model"], r["method"]): len(r["round_seconds"]) for r in out}
    assert rounds == {(m, k): 3 if k == "ar" else 1 for m in ("base", "trained") for k in ("hf_greedy", "ar", "jacobi")}
    assert all(r["exact"] and all(s > 0 for s in r["round_seconds"]) for r in out)
    # Per problem: 6 first-round decodes, then in each later round both models' `ar`, the order rotated.
    assert calls[6:10] == [("trained", "ar"), ("base", "ar"), ("base", "ar"), ("trained", "ar")]
    assert len(calls) == 2 * 10
    table = summarize(out, "base")
    [pooled] = [r for r in table if r["model"] == "base" and r["method"] == "ar"]
    assert len(pooled["round_tps"]) == 3 and pooled["round_tps"][0] == pytest.approx(pooled["tps"])
    assert [r["round_tps"] for r in table if r["method"] == "jacobi"] == [[], []]


def test_a_round_that_decodes_other_tokens_makes_the_sample_inexact(evaluator):
    model = evaluator.models["trained"]
    honest, seen = model.methods["ar"], []

    def drifting(prompts, n):  # from its second call on, the last token differs
        run = honest(prompts, n)
        seen.append(1)
        if len(seen) > 1:
            run.sequences = [s[:-1] + [(s[-1] + 1) % 128] for s in run.sequences]
        return run

    model.methods["ar"] = drifting
    try:
        out = evaluator.run(PROBLEMS[:1])
    finally:
        model.methods["ar"] = honest
    [trained_ar] = [r for r in out if (r["model"], r["method"]) == ("trained", "ar")]
    assert not trained_ar["exact"] and trained_ar["first_divergence"] == len(trained_ar["tokens"])
    assert all(r["exact"] for r in out if r is not trained_ar)
