"""The program in a code completion: a fenced block, or the raw text."""

from __future__ import annotations

import re

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", flags=re.DOTALL | re.IGNORECASE)


def extract_program(completion: str, prompt: str = "", entry_point: str | None = None) -> str:
    """The code to run for a completion.

    A fenced block wins (the one defining `entry_point` if any does, else the longest);
    otherwise the completion is taken as code. When the code does not define
    `entry_point` it is read as the continuation of `prompt` (HumanEval's
    signature-and-docstring prompts), so the prompt is put before it.
    """
    blocks = [b for b in FENCE.findall(completion) if b.strip()]
    if blocks:
        defining = [b for b in blocks if entry_point and _defines(b, entry_point)]
        code = (defining or sorted(blocks, key=len))[-1]
    else:
        code = completion
    if entry_point and not _defines(code, entry_point):
        code = prompt + code
    return code.rstrip() + "\n"


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, flags=re.MULTILINE) is not None
