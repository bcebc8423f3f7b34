"""The evaluation benchmarks: where they load from, how they are asked, how answers are scored.

| name | rows | local copy (under the shared data dir) | hub id |
|---|---|---|---|
| humaneval | 164 | eval/humaneval.jsonl.gz | openai/openai_humaneval, test |
| mbpp | 257 | eval/mbpp_sanitized_test.jsonl | google-research-datasets/mbpp, sanitized, test |
| mbpp_full | 500 | eval/mbpp_test.jsonl | google-research-datasets/mbpp, full, test |
| gsm8k | 1319 | eval/gsm8k_test.jsonl | openai/gsm8k, main, test |
| math500 | 500 | eval/math500_test.jsonl | HuggingFaceH4/MATH-500, test |

Prompts (the user turn; the model's chat template wraps it):
- math: the problem, then "Please reason step by step, and put your final answer within \\boxed{}."
- HumanEval: "Complete the following Python function. ..." and the prompt in a python code block.
- MBPP: the task text, its tests ("Your code should pass these tests: ..."), and a request for a code block.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from jfcore.config import ConfigError, check
from jfcore.evaluation.answers import gsm8k_correct, gsm8k_gold, math_correct
from jfcore.evaluation.code import CodeProblem, humaneval_problem, mbpp_problem, score_completion
from jfcore.paths import EVAL_FILES, default_data_dir

BenchmarkName = Literal["humaneval", "mbpp", "mbpp_full", "gsm8k", "math500"]
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True, kw_only=True)
class BenchmarkConfig:
    name: BenchmarkName
    path: str | None = None  # a local JSONL/JSON/Parquet file, or a hub id; default: the shared copy
    limit: int | None = None  # the first `limit` problems (after shuffling, when seed is set)
    seed: int | None = None  # shuffle with this seed before `limit`; None keeps the file's order

    def __post_init__(self) -> None:
        check(self.limit is None or self.limit >= 1, f"BenchmarkConfig.limit: must be >= 1, got {self.limit}")


class Score(NamedTuple):
    correct: bool
    verdict: str  # code: the sandbox's status (passed, failed, timeout, load_error, error); math: correct or wrong
    detail: str  # why, for a reader ("failed: assertion failed", "wrong answer")


@dataclass(frozen=True)
class Problem:
    benchmark: str
    id: str
    prompt: str  # the user message
    gold: str  # the reference answer (math) or program (code)
    code: CodeProblem | None = None

    def score(self, completion: str, isolated: bool = True) -> Score:
        """How one completion scores, through the same path for models and references."""
        if self.code is not None:
            verdict = score_completion(self.code, completion, isolated=isolated)
            detail = verdict.status if verdict.passed else f"{verdict.status}: {verdict.detail}"
            return Score(verdict.passed, verdict.status, detail)
        judge = gsm8k_correct if self.benchmark == "gsm8k" else math_correct
        correct = judge(completion, self.gold)
        return Score(correct, "correct" if correct else "wrong", "correct" if correct else "wrong answer")

    def reference_completion(self) -> str:
        """A completion made of the gold solution, written the way a model would answer."""
        if self.code is not None:
            return f"```python\n{self.code.reference}\n```"
        return f"The answer is \\boxed{{{self.gold}}}."


def ask_math(problem: str) -> str:
    return f"{problem}\n{MATH_INSTRUCTION}"


def ask_function(code: str) -> str:
    return (
        "Complete the following Python function. Reply with the whole function in a ```python code block.\n\n"
        f"```python\n{code}```"
    )


def ask_mbpp(task: str, tests: list[str]) -> str:
    tests_text = "\n".join(tests)
    return (
        f"{task}\nYour code should pass these tests:\n\n{tests_text}\n\nReply with the code in a ```python code block."
    )


def _humaneval(row: dict) -> Problem:
    code = humaneval_problem(row)
    return Problem("humaneval", row["task_id"], ask_function(row["prompt"]), code.reference, code)


def _mbpp(name: str) -> Callable[[dict], Problem]:
    def make(row: dict) -> Problem:
        code = mbpp_problem(row, name)
        return Problem(name, str(row["task_id"]), ask_mbpp(code.prompt, row["test_list"]), code.reference, code)

    return make


def _gsm8k(row: dict) -> Problem:
    return Problem("gsm8k", row["id"], ask_math(row["question"]), gsm8k_gold(row["answer"]))


def _math500(row: dict) -> Problem:
    return Problem("math500", row["unique_id"], ask_math(row["problem"]), row["answer"])


@dataclass(frozen=True)
class _Spec:
    hub: tuple[str, str | None, str]  # id, config, split
    make: Callable[[dict], Problem]


SPECS: dict[str, _Spec] = {
    "humaneval": _Spec(("openai/openai_humaneval", None, "test"), _humaneval),
    "mbpp": _Spec(("google-research-datasets/mbpp", "sanitized", "test"), _mbpp("mbpp")),
    "mbpp_full": _Spec(("google-research-datasets/mbpp", "full", "test"), _mbpp("mbpp_full")),
    "gsm8k": _Spec(("openai/gsm8k", "main", "test"), _gsm8k),
    "math500": _Spec(("HuggingFaceH4/MATH-500", None, "test"), _math500),
}


def _read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.name.endswith((".json", ".json.gz")):
            data = json.load(f)
            return data if isinstance(data, list) else data["data"]
        return [json.loads(line) for line in f if line.strip()]


def _hub_rows(hub_id: str, config: str | None, split: str) -> list[dict]:
    import datasets

    try:
        return list(datasets.load_dataset(hub_id, config, split=split))
    except Exception as err:  # offline, unknown id, missing split: all get the same advice
        raise FileNotFoundError(
            f"could not load {hub_id} ({config or 'default'}, {split}) from the hub: {err}. "
            "Offline, give the benchmark's local file as `path` (the shared copies are under eval/ of $JF_SHARED_DATA)"
        ) from err


def benchmark_source(config: BenchmarkConfig, data_dir: str | Path | None = None) -> str:
    """Where `load_benchmark` reads the benchmark from: a local file, or a hub id."""
    if config.path is not None:
        path = Path(config.path).expanduser()
        return str(path.resolve()) if path.is_file() else config.path
    local = Path(data_dir or default_data_dir()) / EVAL_FILES[config.name]
    return str(local.resolve()) if local.is_file() else SPECS[config.name].hub[0]


def load_benchmark(config: BenchmarkConfig, data_dir: str | Path | None = None) -> list[Problem]:
    """The problems of one benchmark, from `config.path`, else the shared local copy, else the hub."""
    if config.name not in SPECS:
        raise ConfigError(f"unknown benchmark {config.name!r}; known: {', '.join(SPECS)}")
    spec = SPECS[config.name]
    local = Path(data_dir or default_data_dir()) / EVAL_FILES[config.name]
    if config.path is not None and Path(config.path).expanduser().is_file():
        rows = _read_rows(Path(config.path).expanduser())
    elif config.path is not None and (config.path.startswith(("/", ".", "~")) or Path(config.path).suffix):
        raise FileNotFoundError(
            f"{config.name}: no file at {config.path}; give a JSONL, JSON or Parquet file, or a hub id"
        )
    elif config.path is not None:
        rows = _hub_rows(config.path, spec.hub[1], spec.hub[2])
    elif local.is_file():
        rows = _read_rows(local)
    else:
        rows = _hub_rows(*spec.hub)
    for index, row in enumerate(rows):
        row.setdefault("id", f"{config.name}/{index}")  # GSM8K rows have no id of their own
    if config.seed is not None:
        random.Random(config.seed).shuffle(rows)
    try:
        return [spec.make(row) for row in rows[: config.limit]]
    except KeyError as err:
        raise ConfigError(f"{config.name}: the rows have no field {err}; is this the {config.name} benchmark?") from err
