"""Math answer scoring: every gold answer scores, equivalent forms match, wrong answers do not."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from jfcore.evaluation.answers import final_number, gsm8k_correct, gsm8k_gold, last_boxed, math_correct
from jfcore.paths import default_data_dir

EVAL = default_data_dir() / "eval"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EVAL / name).read_text().splitlines() if line.strip()]


def test_every_gsm8k_gold_solution_scores_through_the_model_path():
    data = rows("gsm8k_test.jsonl")
    assert len(data) == 1319
    assert all(gsm8k_correct(r["answer"], gsm8k_gold(r["answer"])) for r in data)
    # ... and the next problem's gold solution is wrong for each (unless both answers are equal)
    wrong = [(a, b) for a, b in pairwise(data) if gsm8k_gold(a["answer"]) != gsm8k_gold(b["answer"])]
    assert not any(gsm8k_correct(b["answer"], gsm8k_gold(a["answer"])) for a, b in wrong)


def test_every_math500_gold_solution_scores_through_the_model_path():
    data = rows("math500_test.jsonl")
    assert len(data) == 500
    assert [r["unique_id"] for r in data if not math_correct(r["solution"], r["answer"])] == []
    shifted = [(a, b) for a, b in pairwise(data) if a["answer"].replace(" ", "") != b["answer"].replace(" ", "")]
    false_matches = [a["unique_id"] for a, b in shifted if math_correct(b["solution"], a["answer"])]
    # One pair is a true match in another form: gold "5" and the next problem's "x=5".
    assert len(false_matches) <= 1, false_matches


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("so the answer is \\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{[2, 5)}", "[2,5)"),
        ("\\boxed{\\text{(C)}}", "\\text{(C)}"),
        ("\\boxed{90^\\circ}", "90"),
    ],
)
def test_math_equivalent_forms_match(completion, gold):
    assert math_correct(completion, gold)


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("\\boxed{3}", "2"),
        ("no boxed answer: 2", "2"),  # the answer must be boxed, as the prompt asks
        ("\\boxed{\\frac{1}{3}}", "0.33"),
        ("\\boxed{(3, \\pi)}", "(3,\\frac{\\pi}{2})"),
        ("\\boxed{2} then changed my mind \\boxed{4}", "2"),  # the last boxed answer counts
    ],
)
def test_math_wrong_answers_do_not_match(completion, gold):
    assert not math_correct(completion, gold)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("The answer is $1,234.", "$1,234"),
        ("... so she pays \\boxed{-7.50} dollars", "-7.50"),
        ("First 3 apples, then 4 more, 7 in total.", "7"),
        ("The answer is 12. Check: 12 * 2 = 24.", "12"),
        ("no digits here", None),
    ],
)
def test_gsm8k_final_number(completion, expected):
    assert final_number(completion) == expected


def test_gsm8k_numbers_compare_as_numbers():
    assert gsm8k_correct("The answer is 1,234.00", "1234")
    assert gsm8k_correct("#### 0.5", "0.50")
    assert not gsm8k_correct("#### 18", "17")
    assert not gsm8k_correct("I don't know", "17")
    with pytest.raises(ValueError, match="####"):
        gsm8k_gold("no marker")


def test_last_boxed_balances_braces():
    assert last_boxed("x \\boxed{\\frac{a}{b}} y") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{1} and \\fbox{2}") == "2"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("nothing") is None
