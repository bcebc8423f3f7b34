"""Random and malformed arguments to the C step's entry points (`_native.layout`, `greedy`, `verify`): each call
must return a result or raise a Python error. Run as a script (`python -m tests.support.native_fuzz SEED CASES`)
so that a crash shows as the process's exit status, not as a dead test session; prints a JSON summary."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter

import numpy as np
import torch

from jfcore.decoding import DecodeConfig
from jfcore.decoding.candidates.ngram_pool import NgramPool
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.rules.native import _native
from jfcore.decoding.rules.python import PythonRules
from tests.support.tiny_models import tiny_model

ERRORS = (TypeError, ValueError, OverflowError, AttributeError, IndexError, RuntimeError, MemoryError)


def _rows(rules: PythonRules, rng: random.Random, count: int) -> list:
    rows = []
    for i in range(count):
        row = rules.new_row(i, [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))])
        rules.begin(row, rng.randrange(1, 50))
        rows.append(row)
    return rows


def _spoil_row(row, rng: random.Random):
    """One malformed field, or the row as it is."""
    match rng.randrange(9):
        case 0:
            row.sizes = row.sizes[:-1]  # fewer sizes than blocks
        case 1:
            row.sizes = [*row.sizes, 4, 4]
        case 2:
            row.blocks = [tuple(b) for b in row.blocks]
        case 3:
            row.blocks = [[*b, "x"] for b in row.blocks]
        case 4:
            row.pool = NgramPool(2, 3)
        case 5:
            row.out = None
        case 6:
            row.blocks = []
            row.sizes = []
        case 7:
            return rng.choice([None, 7, "row", object()])
    return row


def _buffer(rng: random.Random, items: int, kind: str):
    """A buffer of about `items` items: right or wrong length, right or wrong type, typed or raw bytes."""
    n = max(0, items + rng.choice([0, 0, 0, -1, 1, -items, 3]))
    dtype = rng.choice(
        {"f": [np.float32, np.float32, np.float64, np.int64], "q": [np.int64, np.int64, np.int32, np.float64]}[kind]
    )
    array = np.asarray([rng.randrange(-3, 60) for _ in range(n)], dtype=dtype)
    return rng.choice([array, bytearray(array.tobytes()), bytes(array.tobytes()), memoryview(array), "nope", None])


def fuzz(seed: int, cases: int) -> dict:
    rng = random.Random(seed)
    model = tiny_model("llama")
    rules = Decoder(model, DecodeConfig(method="multiblock", block_size=4, pool_size=2), [], 0).rules
    outcomes: Counter = Counter()
    for _ in range(cases):
        entry = rng.choice(["layout", "greedy", "verify", "verify"])
        try:
            if entry == "greedy":
                rows_, width, vocab = rng.randrange(-2, 5), rng.randrange(-2, 5), rng.randrange(-1, 40)
                valid = None
                if rng.random() < 0.5:
                    mask = np.asarray([rng.random() < 0.6 for _ in range(max(0, rows_ * width))], dtype=np.bool_)
                    valid = rng.choice([bytearray(mask.tobytes()), mask, bytearray(b"\x01" * rng.randrange(0, 30))])
                queries = max(0, rows_ * width) if valid is None else rng.randrange(0, 30)
                _native.greedy(_buffer(rng, queries * max(vocab, 0), "f"), valid, rows_, width, vocab)
            else:
                rows = [_spoil_row(r, rng) if rng.random() < 0.3 else r for r in _rows(rules, rng, rng.randrange(4))]
                max_candidates = rng.choice([2, 2, 2, 0, -1, 1 << 20])
                if entry == "layout":
                    _native.layout(rows, rng.randrange(-1, 50), max_candidates, rng.random() < 0.5, False)
                else:
                    good = _rows(rules, rng, len(rows))
                    tokens, _, _, _, meta, width, _ = _native.layout(good, 0, 2, False, False)
                    meta = np.frombuffer(bytes(meta), dtype=np.int64).copy()
                    for _ in range(rng.randrange(3)):  # slots past the step, negative counts, huge values
                        if len(meta):
                            meta[rng.randrange(len(meta))] = rng.choice([-1, 0, width, width + 1, 99, 1 << 40])
                    meta = rng.choice([meta, meta[: rng.randrange(len(meta) + 1)], np.append(meta, 3)])
                    choices = np.asarray([rng.randrange(50) for _ in range(len(good) * width)], dtype=np.int64)
                    if rng.random() < 0.3:
                        choices, tokens = _buffer(rng, len(choices), "q"), _buffer(rng, len(choices), "q")
                    width = rng.choice([width, width, width + 1, width - 1, -1, 1 << 62])
                    rows = rows if rng.random() < 0.5 else good
                    eos = rng.choice([(), (3,), "ab", None, (1 << 70,)])
                    _native.verify(
                        rows, tokens, choices, meta, width, eos, 4, 2, 0.85, rng.random() < 0.3, False, rules
                    )
            outcomes[f"{entry}: result"] += 1
        except ERRORS as error:
            outcomes[f"{entry}: {type(error).__name__}"] += 1
    return dict(sorted(outcomes.items()))


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(fuzz(int(sys.argv[1]), int(sys.argv[2]))))
