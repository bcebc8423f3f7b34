"""HumanEval and MBPP problems as sandbox judgements of a completion.

CPU budgets: each benchmark's budget is set from its slowest reference solution,
measured in the sandbox (audit hook included) by `python -m bench.sandbox_budget` on
the reference machine (2-core x86_64 VM, CPython 3.11), with a margin of 5x or more so
that a correct but less efficient solution than the reference still passes; all other
references need under 0.1 s:

| benchmark | slowest reference | its CPU time | budget |
|---|---|---|---|
| humaneval | HumanEval/75 | 0.15-0.22 s | 5 s (25x) |
| mbpp, mbpp_full | task 123 (sum of amicable numbers below 9999) | 2.85-2.99 s | 15 s (5x) |

A host that runs Python slower gets proportionally more (`jfcore.hostspeed.slowdown`),
and the wall clock is only a backstop (`jfcore.evaluation.sandbox`), so neither a slow nor a
busy host fails a correct program. A program over its budget gets the verdict
"timeout", which the results table counts apart from wrong answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jfcore.environment import usable_cores
from jfcore.evaluation.programs import extract_program
from jfcore.evaluation.sandbox import SandboxLimits, Verdict, judge
from jfcore.hostspeed import scaled

CPU_BUDGET_S = {"humaneval": 5.0, "mbpp": 15.0, "mbpp_full": 15.0}  # reference-machine seconds; see above


def judge_workers() -> int:
    """Judges to run at once: no more than the cores this process may use, so none waits for a core."""
    return usable_cores()


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
    cpu_budget_s: float  # the benchmark's CPU budget in reference-machine seconds (CPU_BUDGET_S)


def humaneval_problem(row: dict) -> CodeProblem:
    return CodeProblem(
        task_id=row["task_id"],
        prompt=row["prompt"],
        stub=row["prompt"],
        context=row["prompt"],
        tests=f"{row['test']}\ncheck({row['entry_point']})\n",
        after="",
        entry_point=row["entry_point"],
        reference=row["prompt"] + row["canonical_solution"],
        cpu_budget_s=CPU_BUDGET_S["humaneval"],
    )


def mbpp_problem(row: dict, benchmark: str = "mbpp") -> CodeProblem:
    """Sanitized rows (prompt, test_imports) and full rows (text, test_setup_code) alike."""
    tests = "\n".join(row["test_list"]) + "\n"
    called = re.findall(r"(\w+)\s*\(", tests)
    entry = next((name for name in called if re.search(rf"^def\s+{name}\s*\(", row["code"], re.MULTILINE)), None)
    return CodeProblem(
        task_id=str(row["task_id"]),
        prompt=row.get("prompt") or row["text"],
        stub="",
        context="\n".join(row.get("test_imports") or []),
        tests=tests,
        after=row.get("test_setup_code") or "",
        entry_point=entry,
        reference=row["code"],
        cpu_budget_s=CPU_BUDGET_S[benchmark],
    )


def score_completion(
    problem: CodeProblem, completion: str, limits: SandboxLimits | None = None, isolated: bool = True
) -> Verdict:
    """Pass@1 verdict of one completion: its program, judged by the problem's tests.

    `limits` default to the problem's CPU budget scaled to this host; `isolated=False` is the unsafe flag.
    """
    program = extract_program(completion, problem.stub, problem.entry_point)
    limits = limits or SandboxLimits(cpu_s=scaled(problem.cpu_budget_s))
    return judge(program, problem.tests, context=problem.context, after=problem.after, limits=limits, isolated=isolated)
