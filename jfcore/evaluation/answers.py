"""Final answers of math completions: extraction and equivalence (GSM8K, MATH-500).

GSM8K: the final number. A completion's answer is, in order of preference, the
number after "####", inside the last \\boxed{}, after "answer is", else the
last number in the text; numbers compare exactly as fractions after dropping
thousands separators, currency and percent signs, and trailing zeros.

MATH-500: the last \\boxed{} (or \\fbox{}) of the completion, judged against the
gold answer by math-verify (LaTeX parsed to sympy: 0.5 == \\frac{1}{2},
(3, \\frac{\\pi}{2}) == (3,\\pi/2), intervals, sets, matrices), with normalized
string equality as a second chance for answers sympy cannot parse (text,
multiple-choice letters).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        rest = text[start:].split(maxsplit=1)  # "\boxed 5"
        return rest[1].split("$")[0].strip() if len(rest) > 1 else None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1 : i].strip()
    return None


def _to_fraction(token: str) -> Fraction | None:
    cleaned = token.replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_gold(answer: str) -> str:
    """The gold number of a GSM8K `answer` field (the text after "####")."""
    if "####" not in answer:
        raise ValueError(f"a GSM8K answer ends with '#### N'; this one does not: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def final_number(text: str) -> str | None:
    """The final numeric answer of a completion, or None."""
    if "####" in text:
        found = NUMBER.findall(text.rsplit("####", 1)[1])
        if found:
            return found[0]
    boxed = last_boxed(text)
    if boxed is not None:
        found = NUMBER.findall(boxed.replace("\\!", "").replace("{,}", ","))
        if found:
            return found[-1]
    match = re.search(r"answer is[:\s]*(.*)", text, flags=re.IGNORECASE | re.DOTALL)
    if match:
        found = NUMBER.findall(match.group(1))
        if found:
            return found[0]
    found = NUMBER.findall(text)
    return found[-1] if found else None


def gsm8k_correct(completion: str, gold: str) -> bool:
    predicted = final_number(completion)
    if predicted is None:
        return False
    a, b = _to_fraction(predicted), _to_fraction(gold)
    return a is not None and b is not None and a == b


def _normalized(answer: str) -> str:
    answer = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", answer)
    answer = re.sub(r"\\(?:left|right|displaystyle|,|!|;|:)", "", answer)
    answer = (
        answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^\\circ", "").replace("^{\\circ}", "")
    )
    return re.sub(r"\s+", "", answer).strip("$.").lower()


def math_correct(completion: str, gold: str) -> bool:
    """Is the completion's last boxed answer equivalent to the gold MATH answer?"""
    from math_verify import parse, verify

    predicted = last_boxed(completion)
    if predicted is None:
        return False
    if _normalized(predicted) == _normalized(gold):
        return True
    # math-verify's timeouts (against sympy blowing up) use SIGALRM, which works on the main thread only.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    predicted_parsed = parse(f"$\\boxed{{{predicted}}}$", parsing_timeout=timeout)
    return bool(gold_parsed and predicted_parsed and verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))
