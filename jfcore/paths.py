"""Where the shared data lives, and the evaluation prompt sets in it.

The data folder is `$JF_SHARED_DATA` if set, else `shared/data` beside the repository
(`<repo>/../shared/data`): jfcore.environment.shared_data_dir.
"""

from __future__ import annotations

from pathlib import Path

from jfcore.chat import read_jsonl
from jfcore.environment import shared_data_dir

# benchmark -> its shared copy under the data dir (jfcore.evaluation.benchmarks loads these too)
EVAL_FILES: dict[str, str] = {
    "humaneval": "eval/humaneval.jsonl.gz",
    "mbpp": "eval/mbpp_sanitized_test.jsonl",
    "mbpp_full": "eval/mbpp_test.jsonl",
    "gsm8k": "eval/gsm8k_test.jsonl",
    "math500": "eval/math500_test.jsonl",
}
# the sets the decoding demo and benchmark read prompts from -> the field holding the prompt text
EVAL_SETS: dict[str, str] = {"gsm8k": "question", "humaneval": "prompt", "mbpp": "prompt"}


default_data_dir = shared_data_dir


def eval_prompts(name: str, limit: int | None = None, data_dir: str | Path | None = None) -> list[str]:
    """The first `limit` prompt texts of the evaluation set `name` (see EVAL_SETS)."""
    if name not in EVAL_SETS:
        raise KeyError(f"unknown evaluation set '{name}' (known: {', '.join(EVAL_SETS)})")
    relative, field = EVAL_FILES[name], EVAL_SETS[name]
    path = Path(data_dir) if data_dir is not None else default_data_dir()
    if not (path / relative).is_file():
        raise FileNotFoundError(
            f"{name} prompts not found at {path / relative}; point --data-dir or $JF_SHARED_DATA at the shared data"
        )
    return read_jsonl(path / relative, field, limit)
