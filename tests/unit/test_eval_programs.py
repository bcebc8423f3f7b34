"""Finding the program in a code completion."""

from __future__ import annotations

from jfcore.evaluation.programs import extract_program

PROMPT = 'def add(a, b):\n    """Add two numbers."""\n'


def test_fenced_block_defining_the_entry_point_wins():
    completion = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\nUsage:\n```\nprint(add(1, 2))\n```"
    assert extract_program(completion, PROMPT, "add") == "def add(a, b):\n    return a + b\n"


def test_body_continuation_gets_the_prompt_in_front():
    assert extract_program("    return a + b\n", PROMPT, "add") == PROMPT + "    return a + b\n"


def test_raw_full_function_is_kept_as_is():
    code = "import math\n\ndef add(a, b):\n    return a + b\n"
    assert extract_program(code, PROMPT, "add") == code


def test_unclosed_fence_and_no_entry_point():
    assert extract_program("```py\nx = 1\nprint(x)") == "x = 1\nprint(x)\n"
    assert extract_program("```python\na = 1\n```\n```python\nb = 2\nc = 3\n```") == "b = 2\nc = 3\n"
