"""The rules in C (jfcore/decoding/rules/native.py, _step.c) against the Python rules (rules/python.py)."""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from jfcore.decoding import DecodeConfig, StepEvent
from jfcore.decoding.candidates.ngram_pool import NgramPool
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.row import Row
from jfcore.decoding.rules import native
from jfcore.decoding.rules.native import NativeRules, _native
from jfcore.decoding.rules.python import PythonRules
from tests.support.tiny_models import ARCHITECTURES, VOCAB, tiny_model


def test_the_c_rules_are_built_and_taken_for_every_method():
    """The install builds them where a C compiler is at hand (pyproject.toml); without one decoding goes on with
    the Python rules, and this test says so. The decoder is the one place that picks them."""
    assert native.available(), "jfcore/decoding/rules/_step.c was not built: install a C compiler, pip install -e ."
    m = tiny_model("llama")
    for config in (
        DecodeConfig(method="ar"),
        DecodeConfig(method="jacobi"),
        DecodeConfig(method="multiblock"),
        DecodeConfig(method="ar", lookup_tokens=2),
        DecodeConfig(method="multiblock", lookup_tokens=2),
        DecodeConfig(method="jacobi", record_trajectories=True),
    ):
        assert type(Decoder(m, config, [], 0).rules) is NativeRules, config.describe()
        assert type(Decoder(m, config, [], 0, rules="python").rules) is PythonRules
    with pytest.raises(ValueError, match="rules must be"):
        Decoder(m, DecodeConfig(), [], 0, rules="c")


def test_the_c_codes_contract_names_only_what_python_has():
    """The C rules read and write `Row` fields by name and call back methods of the rules object by name: every
    field they name is a field of `Row`, every callback a public method of `PythonRules`, and the C source calls
    back nothing else."""
    fields = {f.name for f in dataclasses.fields(Row)}
    assert set(_native.ROW_FIELDS) <= fields, set(_native.ROW_FIELDS) - fields
    assert len(_native.ROW_FIELDS) == 14  # a name dropped from the C list would go unchecked
    for name in _native.CALLBACKS:
        assert not name.startswith("_") and callable(getattr(PythonRules, name, None)), name
    source = (Path(native.__file__).parent / "_step.c").read_text()
    assert set(re.findall(r'PyObject_CallMethod\(rules->callbacks, "(\w+)"', source)) == set(_native.CALLBACKS)
    assert "PyObject_CallMethod(" not in re.sub(r'PyObject_CallMethod\(rules->callbacks, "\w+"', "", source)
    assert "GetAttrString" not in source and "SetAttrString" not in source  # every name goes through ROW_FIELDS


def _run(decoder: Decoder, prompts):
    events: list[StepEvent] = []
    decoder.on_step = events.append
    out = decoder.decode(prompts)
    s = out.stats
    trajectories = None if out.trajectories is None else [[(b.start, b.states) for b in t] for t in out.trajectories]
    return out.sequences, s.forwards_per_row, s.forward_calls, s.recycled_tokens, events, trajectories


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rows_in_c_follow_the_python_rules_exactly(arch):
    """Same tokens, forwards per row, recycled tokens, per-step events (widths, cache lengths) and recorded
    trajectories as the Python rules, over methods, block sizes, rolling windows, blocks in flight, pools, prompt lookup (beside and within the draft), spawn
    ratios, fillers, EOS sets, budgets, sampled rows and ragged batches; prompts repeat phrases, so pooled and
    copied candidates win and move their slots."""
    m = tiny_model(arch)
    rng = random.Random(arch)
    recycled = finished_early = recorded = 0
    cases = []
    for case in range(12):
        phrases = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 5))] for _ in range(3)]
        prompts = [
            [t for _ in range(rng.randrange(1, 6)) for t in rng.choice(phrases)] for _ in range(rng.choice([1, 3, 7]))
        ]
        config = DecodeConfig(
            method=rng.choice(["ar", "jacobi", "multiblock", "multiblock"]),
            block_size=rng.choice([2, 3, 5, 8, 16]),
            max_new_tokens=rng.choice([1, 5, 40, 64]),
            num_blocks=rng.choice([1, 2, 3]),
            pool_size=rng.choice([0, 2, 4, 4]),
            ngram_size=rng.choice([2, 3, 5]),
            spawn_ratio=rng.choice([0.5, 0.85, 1.0]),
            filler=rng.choice(["context", "random"]),
            seed=case,
            temperature=rng.choice([0.0, 0.0, 0.9]),
            lookup_tokens=rng.choice([0, 0, 2, 6]),
            lookup_ngram=rng.choice([1, 2, 3]),
        )
        if config.lookup_tokens and config.method != "ar" and rng.random() < 0.5:
            config = replace(config, lookup_within=True)
        if config.method == "jacobi" and rng.random() < 0.4:
            config = replace(config, rolling=True)
        elif config.method == "jacobi" and not config.lookup_tokens and not config.temperature and rng.random() < 0.7:
            config = replace(config, record_trajectories=True)
        text = Decoder(m, config, [], 0).decode(prompts[:1]).sequences[0]  # EOS that some row meets
        eos = rng.choice([[], [text[len(text) // 2]], [3, text[-1]]])
        cases.append((config, prompts, eos))
    # Long multiblock decodes: pooled candidates win (each architecture's model repeats itself within 120 tokens),
    # and the copied candidate is sometimes one of them (verified once).
    long = DecodeConfig(method="multiblock", block_size=8, max_new_tokens=120, spawn_ratio=0.5)  # spawns at 4 of 8
    cases.append((long, [[5, 6, 7, 8], [9, 10]], []))
    cases.append((replace(long, lookup_tokens=6, lookup_ngram=2), [[5, 6, 7, 8] * 4, [9, 10]], []))
    # Recorded trajectories: blocks used up, and rows that end at EOS or their budget mid-block.
    recording = DecodeConfig(method="jacobi", block_size=4, max_new_tokens=30, record_trajectories=True)
    text = Decoder(m, recording, [], 0).decode([[9, 10, 11]]).sequences[0]
    cases.append((recording, [[5, 6, 7], [9, 10, 11], [3]], [text[13]]))
    # The rolling window, topped up with the model's guess and filler, beside copied text and near the budget.
    rolling = DecodeConfig(method="jacobi", block_size=5, max_new_tokens=63, rolling=True, filler="random")
    cases.append((rolling, [[5, 6, 7, 8] * 3, [9, 10], [4]], [text[13]]))
    cases.append((replace(rolling, lookup_tokens=4, lookup_ngram=2, lookup_within=True), [[5, 6, 7, 8] * 3, [9]], []))
    for config, prompts, eos in cases:
        in_c, python = Decoder(m, config, eos, 0), Decoder(m, config, eos, 0, rules="python")
        got, expected = _run(in_c, prompts), _run(python, prompts)
        assert got == expected, config.describe()
        recycled += got[3]
        recorded += bool(got[5])
        finished_early += sum(len(s) < config.max_new_tokens for s in got[0])
    assert recycled > 0 and finished_early > 0 and recorded  # candidates won, EOS ended rows, trajectories recorded


def test_above_the_c_choice_size_torchs_choice_feeds_the_same_rules(monkeypatch):
    """Over many logits the step takes torch's greedy choice (`C_CHOICE_LOGITS`): the same decodes as the Python
    rules, here with every step over that size."""
    monkeypatch.setattr(native, "C_CHOICE_LOGITS", 0)
    m = tiny_model("qwen2")
    prompts = [[5, 6, 7, 8] * 3, [9, 10], [11]]
    for config in (
        DecodeConfig(method="multiblock", block_size=8, max_new_tokens=60, lookup_tokens=3),
        DecodeConfig(method="jacobi", block_size=4, max_new_tokens=30, record_trajectories=True),
        DecodeConfig(method="ar", max_new_tokens=30, lookup_tokens=4, lookup_ngram=2),
    ):
        python = Decoder(m, config, [], 0, rules="python")
        assert _run(Decoder(m, config, [], 0), prompts) == _run(python, prompts), config.describe()


def test_the_c_greedy_choice_is_torchs():
    """The first index of the largest logit, the first NaN where there is one; for packed queries (padding
    chooses 0) and for every query."""
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 16, 33, 2048, 2051):
        logits = torch.randn(5, 3, vocab, generator=gen)
        logits[0, 0] = 1.0  # all equal: index 0
        logits[0, 1, -1] = logits[0, 1].max() + 1  # the tail past the last whole vector
        logits[1, 0, vocab // 2 :] = float("nan")
        logits[1, 1, vocab - 1] = float("nan")
        logits[1, 2] = float("-inf")
        logits[2, 0, :] = 0.0
        logits[2, 0, vocab // 3] = -0.0  # equal to 0.0: the first one wins
        logits[2, 1, vocab // 2 :] = 50.0  # a tie: the first of them
        expected = logits.max(-1).indices
        whole = _native.greedy(logits.numpy(), None, 5, 3, vocab)
        assert torch.equal(torch.frombuffer(whole, dtype=torch.long).view(5, 3), expected), vocab
        valid = torch.rand(5, 3, generator=gen) < 0.6
        packed = _native.greedy(logits[valid].numpy(), bytearray(valid.numpy().tobytes()), 5, 3, vocab)
        assert torch.equal(torch.frombuffer(packed, dtype=torch.long).view(5, 3), expected.where(valid, 0)), vocab


def test_the_c_step_says_what_is_wrong():
    m = tiny_model("llama")
    decoder = Decoder(m, DecodeConfig(method="multiblock", block_size=4, pool_size=2), [], 0)
    row = decoder.rules.new_row(0, [5, 6, 7])
    decoder.rules.begin(row, 9)
    for pool in (
        NgramPool(2, 3),
        _native.NgramPool.__new__(_native.NgramPool),
    ):  # the Python pool; a C one never initialised
        row.pool = pool
        with pytest.raises(TypeError, match="pool in C"):
            _native.layout([row], 0, 2, False, False)
    with pytest.raises(RuntimeError, match="__init__ was not called"):
        _native.PromptLookup.__new__(_native.PromptLookup).extend([1, 2])
    with pytest.raises(ValueError, match="logits: expected 256 bytes"):
        _native.greedy(torch.zeros(2, 16).numpy(), None, 1, 1, 64)


def test_malformed_arguments_to_the_c_step_raise_python_errors():
    """Random and malformed arguments to `layout`, `greedy` and `verify` (meta naming slots past the step, sizes
    that do not match the blocks, wrong buffer lengths and types, non-rows) give a result or a Python error, never
    a crash: the fuzz runs in a process of its own, whose exit status would show one."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.native_fuzz", "0", "3000"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        check=False,  # the exit status is the finding
    )
    assert run.returncode == 0, f"the fuzz process died ({run.returncode}): {run.stderr[-2000:]}"
    outcomes = json.loads(run.stdout.splitlines()[-1])
    for entry in ("layout", "greedy", "verify"):  # each entry point both worked and refused
        assert outcomes.get(f"{entry}: result", 0) > 10, outcomes
        assert sum(n for k, n in outcomes.items() if k.startswith(entry) and not k.endswith("result")) > 10, outcomes
