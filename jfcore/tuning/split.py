"""The tuning split: prompts the tuner measures acceptance on, which evaluation never sees.

By default a few prompts from each training-prompt file of the shared data
(GSM8K train, MATH outside MATH-500, MBPP outside its test tasks, Python
programming puzzles), asked the way the benchmark they stand for asks
(`jfcore.evaluation.benchmarks`), so the tuner sees the same kind of text as
evaluation without seeing evaluation's problems. A split that shares a prompt
with an evaluation benchmark is refused, naming both: a tune chosen on
evaluation problems would flatter the evaluation.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jfcore.config import ConfigError, check
from jfcore.evaluation.benchmarks import BenchmarkConfig, ask_function, ask_math, ask_mbpp, load_benchmark
from jfcore.paths import default_data_dir

Ask = Literal["math", "mbpp", "function", "plain"]


@dataclass(frozen=True, kw_only=True)
class TuningSet:
    path: str  # JSONL(.gz); a relative path is under the shared data dir
    ask: Ask = "plain"  # worded like: math (GSM8K, MATH-500), mbpp (needs test_list), function (HumanEval), plain
    field: str = "prompt"
    limit: int = 3
    seed: int | None = 0  # shuffle before `limit` (None: the file's order)

    def __post_init__(self) -> None:
        check(self.limit >= 1, f"limit: must be >= 1, got {self.limit}")


DEFAULT_SPLIT = (
    TuningSet(path="prompts/gsm8k_train.jsonl", ask="math"),
    TuningSet(path="prompts/math_train.jsonl", ask="math"),
    TuningSet(path="prompts/mbpp_train.jsonl", ask="mbpp"),
    TuningSet(path="prompts/python_puzzles.jsonl"),
)


@dataclass(frozen=True)
class TuningPrompt:
    source: str  # the file's name
    text: str  # the raw prompt (what overlap is checked on)
    ask: str  # the user message


def load_split(sets: Sequence[TuningSet], data_dir: str | Path | None = None) -> list[TuningPrompt]:
    out = []
    for s in sets:
        path = Path(s.path).expanduser()
        if not path.is_absolute():
            path = Path(data_dir or default_data_dir()) / path
        if not path.is_file():
            raise ConfigError(f"tuning split: no file at {path}; give a JSONL file (relative paths: the shared data)")
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if s.seed is not None:
            random.Random(s.seed).shuffle(rows)
        for row in rows[: s.limit]:
            if s.field not in row:
                raise ConfigError(f"tuning split: {path} has no field {s.field!r} (fields: {', '.join(row)})")
            text = row[s.field]
            if s.ask == "math":
                ask = ask_math(text)
            elif s.ask == "function":
                ask = ask_function(text)
            elif s.ask == "mbpp":
                if "test_list" not in row:
                    raise ConfigError(f"tuning split: ask 'mbpp' needs rows with test_list; {path} has none")
                ask = ask_mbpp(text, row["test_list"])
            else:
                ask = text
            out.append(TuningPrompt(path.name, text, ask))
    if not out:
        raise ConfigError("tuning split: no prompts; list at least one file")
    return out


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def check_disjoint(
    split: Sequence[TuningPrompt], benchmarks: Sequence[BenchmarkConfig], data_dir: str | Path | None = None
) -> None:
    """Refuse a split that shares a prompt with any of `benchmarks` (every problem of each, whatever its limit)."""
    raw = [(p, _normal(p.text)) for p in split if len(p.text.strip()) >= 20]
    for bench in benchmarks:
        whole = BenchmarkConfig(name=bench.name, path=bench.path)
        for problem in load_benchmark(whole, data_dir):
            asked = _normal(problem.prompt)
            for prompt, text in raw:
                if text in asked:
                    raise ConfigError(
                        f"tuning split overlaps the evaluation benchmark {bench.name!r}: a prompt of {prompt.source} "
                        f"is problem {problem.id} ({prompt.text[:60]!r}...); tune on prompts evaluation never sees"
                    )
