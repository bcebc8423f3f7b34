"""Greedy Jacobi and multiblock + recycling give exactly `generate(do_sample=False)`'s tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jfcore.decoding import DecodeConfig, decode
from jfcore.decoding.decoder import Decoder
from tests.support.arrivals import run_arrivals
from tests.support.tiny_models import ARCHITECTURES, greedy_reference, position_model, tiny_model

MAX_NEW = 48


@functools.cache
def model(arch: str):
    return position_model() if arch == "position" else tiny_model(arch)


def references(m, prompts, max_new, eos):
    return [greedy_reference(m, p, max_new, eos) for p in prompts]


prompt = st.lists(st.integers(0, 95), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from([*ARCHITECTURES, "position"]),
    method=st.sampled_from(["jacobi", "multiblock"]),
    block_size=st.integers(1, 64),
    prompts=st.one_of(st.lists(prompt, min_size=1, max_size=1), st.lists(prompt, min_size=4, max_size=4)),
    seed=st.integers(0, 2**16),
    filler=st.sampled_from(["context", "random"]),
    eos_at=st.one_of(st.none(), st.integers(0, MAX_NEW - 1)),
    num_blocks=st.integers(2, 3),
    pool_size=st.integers(0, 4),
    rolling=st.booleans(),
)
def test_matches_generate(arch, method, block_size, prompts, seed, filler, eos_at, num_blocks, pool_size, rolling):
    m = model(arch)
    eos = None
    if eos_at is not None:
        # An EOS the model really emits: the token at position eos_at of the first row's output.
        eos = greedy_reference(m, prompts[0], MAX_NEW)[eos_at]
    expected = references(m, prompts, MAX_NEW, eos)
    config = DecodeConfig(
        method=method,
        block_size=block_size,
        max_new_tokens=MAX_NEW,
        seed=seed,
        filler=filler,
        num_blocks=num_blocks,
        pool_size=pool_size,
        ngram_size=min(block_size, 8) if block_size > 1 else 2,
        rolling=rolling and method == "jacobi" and block_size > 1,
    )
    out = decode(m, prompts, config, eos_token_id=[] if eos is None else [eos], pad_token_id=0)
    assert out.sequences == expected


SWEEP_PROMPTS = [[7, 3, 9, 1, 4, 4, 2], [5], [11, 12, 13], [60, 2, 2, 8, 9, 1, 33, 71, 5, 5, 19]]
SWEEP_ARCHS = [*ARCHITECTURES, "position"]


@functools.cache
def sweep_reference(arch: str):
    """EOS is the token row 0 emits at position 37, so it ends row 0 mid-output."""
    eos = greedy_reference(model(arch), SWEEP_PROMPTS[0], 72)[37]
    return eos, references(model(arch), SWEEP_PROMPTS, 72, eos)


@pytest.mark.parametrize("block_size", range(1, 65))
def test_every_block_size(block_size):
    """Block sizes 1..64 (each on a rotating architecture), every method (Jacobi fixed and rolling), a batch of 4
    ragged prompts, an EOS that stops some rows inside a block."""
    arch = SWEEP_ARCHS[block_size % len(SWEEP_ARCHS)]
    eos, expected = sweep_reference(arch)
    assert any(len(e) < 72 for e in expected)  # EOS really stops a row early
    for method, rolling in [("jacobi", False), ("jacobi", block_size > 1), ("multiblock", False)]:
        config = DecodeConfig(method=method, block_size=block_size, max_new_tokens=72, seed=block_size, rolling=rolling)
        out = decode(model(arch), SWEEP_PROMPTS, config, eos_token_id=eos, pad_token_id=0)
        assert out.sequences == expected, f"{arch} {config.describe()}"


def test_ar_and_eager_attention():
    m = tiny_model("llama", attn="eager")
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44, 45]]
    expected = references(m, prompts, 30, None)
    for config in [
        DecodeConfig(method="ar", max_new_tokens=30),
        DecodeConfig(method="multiblock", block_size=8, max_new_tokens=30),
    ]:
        assert decode(m, prompts, config, eos_token_id=[], pad_token_id=0).sequences == expected


def test_matches_batched_generate_with_left_padding():
    """The batched `generate` call users would write (left padding) agrees too."""
    m = tiny_model("qwen2")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 8, 2, 8, 1, 8]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    expected = m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)[:, width:]
    out = decode(m, prompts, DecodeConfig(block_size=5, max_new_tokens=40), eos_token_id=[], pad_token_id=0)
    assert out.sequences == expected.tolist()


def test_recycling_and_long_runs_are_exercised():
    """The property tests above only mean something if drafts are really accepted in long
    runs and recycled n-grams really win sometimes: check that they do."""
    m = model("position")
    prompts = [[5, 6, 7], [9]]
    out = decode(m, prompts, DecodeConfig(method="jacobi", block_size=16, max_new_tokens=64), eos_token_id=[])
    assert out.stats.tpf > 4
    m = model("gpt2")
    out = decode(
        m, [[5, 6, 7, 8]], DecodeConfig(method="multiblock", block_size=16, max_new_tokens=200), eos_token_id=[]
    )
    assert out.stats.recycled_tokens > 0
    assert out.sequences == references(m, [[5, 6, 7, 8]], 200, None)


def test_a_rolling_window_keeps_its_width_where_a_fixed_block_shrinks():
    """Rolling Jacobi tops its window up to n after every forward, so each forward verifies n guesses until the
    budget is near; a fixed block verifies fewer and fewer as it is committed. Both give greedy's tokens."""
    m, n, budget = model("llama"), 6, 60
    expected = references(m, [[7, 3, 9, 1]], budget, None)
    widths = {}
    for rolling in (False, True):
        events = []
        config = DecodeConfig(method="jacobi", block_size=n, max_new_tokens=budget, rolling=rolling)
        out = Decoder(m, config, [], 0, on_step=events.append).decode([[7, 3, 9, 1]])
        assert out.sequences == expected
        done, widths[rolling] = 1, []  # the prefill gives the first token
        for e in events:
            if budget - done >= n:
                widths[rolling].append(e.widths[0])
            done += e.accepted[0]
    assert set(widths[True]) == {n}
    assert min(widths[False]) < n


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from([*ARCHITECTURES, "position"]),
    method=st.sampled_from(["ar", "jacobi", "multiblock"]),
    block_size=st.integers(2, 16),
    arrivals=st.lists(st.tuples(prompt, st.integers(0, 6), st.integers(1, MAX_NEW)), min_size=2, max_size=6),
    cancel=st.one_of(st.none(), st.integers(0, 5)),
)
def test_continuous_batching_matches_generate(arch, method, block_size, arrivals, cancel):
    """Prompts that join a running batch at any step, each with its own token budget, still get exactly their
    own greedy tokens; a row cancelled mid-flight leaves the others untouched."""
    from jfcore.decoding.decoder import Decoder

    m = model(arch)
    config = DecodeConfig(method=method, block_size=block_size, max_new_tokens=MAX_NEW, pool_size=2)
    live = Decoder(m, config, eos_token_ids=[], pad_token_id=0).scheduler()
    rows, cancelled = run_arrivals(live, arrivals, cancel)
    for row, (p, _, budget) in rows:
        if row is cancelled:
            continue
        assert row.out == greedy_reference(m, p, budget), (p, budget)
        assert row.finished
