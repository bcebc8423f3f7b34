"""HumanEval and MBPP problems as sandbox judgements of a completion."""

from __future__ import annotations

import re
from dataclasses import dataclass

from jfcore.eval.programs import extract_program
from jfcore.eval.sandbox import SandboxLimits, Verdict, judge


@dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str  # what the model is asked
    stub: str  # code a completion may continue (HumanEval's signature and docstring; "" for MBPP)
    context: str  # trusted code the tests need (HumanEval: the prompt's helpers; MBPP: imports)
    tests: str
    after: str  # trusted setup run after the program (MBPP test_setup_code)
    entry_point: str | None  # the function under test (None: every function the program defines)
    reference: str  # the canonical solution as a complete program


def humaneval_problem(row: dict) -> CodeProblem:
    return CodeProblem(
        task_id=row["task_id"], prompt=row["prompt"], stub=row["prompt"], context=row["prompt"],
        tests=f"{row['test']}\ncheck({row['entry_point']})\n", after="", entry_point=row["entry_point"],
        reference=row["prompt"] + row["canonical_solution"],
    )  # fmt: skip


def mbpp_problem(row: dict) -> CodeProblem:
    """Sanitized rows (prompt, test_imports) and full rows (text, test_setup_code) alike."""
    tests = "\n".join(row["test_list"]) + "\n"
    called = re.findall(r"(\w+)\s*\(", tests)
    entry = next((name for name in called if re.search(rf"^def\s+{name}\s*\(", row["code"], re.MULTILINE)), None)
    return CodeProblem(
        task_id=str(row["task_id"]), prompt=row.get("prompt") or row["text"], stub="",
        context="\n".join(row.get("test_imports") or []), tests=tests, after=row.get("test_setup_code") or "",
        entry_point=entry, reference=row["code"],
    )  # fmt: skip


def score_completion(problem: CodeProblem, completion: str, limits: SandboxLimits | None = None) -> Verdict:
    """Pass@1 verdict of one completion: its program, judged by the problem's tests."""
    program = extract_program(completion, problem.stub, problem.entry_point)
    return judge(program, problem.tests, context=problem.context, after=problem.after, limits=limits)
