"""Prompt-lookup candidates: lossless in every method, really accepted, and replayed exactly offline."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jfcore.config import ConfigError
from jfcore.decoding import DecodeConfig, decode
from jfcore.decoding.candidates.lookup import PromptLookup
from jfcore.decoding.rules.native import NativeRules, _native
from jfcore.training.copies import lookup_candidates
from jfcore.tuning.replay import simulate
from tests.support.tiny_models import ARCHITECTURES, greedy_reference, position_model, tiny_model

MAX_NEW = 48


@functools.cache
def model(arch: str):
    return position_model() if arch == "position" else tiny_model(arch)


# Prompts that repeat themselves, so copied continuations exist and are sometimes right.
phrase = st.lists(st.integers(0, 95), min_size=1, max_size=6)
prompt = st.tuples(phrase, st.integers(1, 3), st.lists(st.integers(0, 95), max_size=4)).map(
    lambda t: t[0] * t[1] + t[2]
)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from([*ARCHITECTURES, "position"]),
    method=st.sampled_from(["ar", "jacobi", "multiblock"]),
    block_size=st.integers(1, 24),
    prompts=st.one_of(st.lists(prompt, min_size=1, max_size=1), st.lists(prompt, min_size=3, max_size=3)),
    lookup_tokens=st.integers(1, 20),
    lookup_ngram=st.integers(1, 4),
    pool_size=st.integers(0, 3),
    eos_at=st.one_of(st.none(), st.integers(0, MAX_NEW - 1)),
    within=st.booleans(),
)
def test_prompt_lookup_matches_generate(
    arch, method, block_size, prompts, lookup_tokens, lookup_ngram, pool_size, eos_at, within
):
    """Copied candidates beside the draft (positions of their own) or within it (in place of its guesses)."""
    m = model(arch)
    eos = None if eos_at is None else greedy_reference(m, prompts[0], MAX_NEW)[eos_at]
    expected = [greedy_reference(m, p, MAX_NEW, eos) for p in prompts]
    config = DecodeConfig(
        method=method,
        block_size=block_size,
        max_new_tokens=MAX_NEW,
        pool_size=pool_size,
        lookup_tokens=lookup_tokens,
        lookup_ngram=lookup_ngram,
        lookup_within=within and method != "ar" and block_size > 1,
    )
    out = decode(m, prompts, config, eos_token_id=[] if eos is None else [eos], pad_token_id=0)
    assert out.sequences == expected


def test_copied_candidates_are_accepted_and_replayed_exactly():
    """On text that repeats, AR with prompt lookup commits several tokens per forward, and the offline replay
    predicts its forwards exactly (what the tuner relies on)."""
    m, widths = model("qwen3"), []
    prompts = [[5, 6, 7, 8], [40, 41, 40, 41, 40]]
    for lookup_tokens, lookup_ngram in [(4, 1), (10, 3), (1, 2)]:
        config = DecodeConfig(method="ar", max_new_tokens=200, lookup_tokens=lookup_tokens, lookup_ngram=lookup_ngram)
        for p in prompts:
            reference = greedy_reference(m, p, 200)
            out = decode(m, [p], config, eos_token_id=[])
            assert out.sequences == [reference]
            replay = simulate(p, reference, lookup_ngram, lookup_tokens)
            assert out.stats.decode_forwards == replay.forwards, (lookup_tokens, p)
    # This random model falls into a loop on the second prompt, which lookup must exploit, beside or within.
    out = decode(m, [prompts[1]], DecodeConfig(method="ar", max_new_tokens=200, lookup_tokens=10), eos_token_id=[])
    assert out.stats.tpf > 5
    within = DecodeConfig(method="jacobi", block_size=6, max_new_tokens=200, lookup_tokens=5, lookup_within=True)
    out = decode(m, [prompts[1]], within, eos_token_id=[], on_step=lambda e: widths.extend(e.widths))
    assert out.stats.tpf > 4 and max(widths) == 6  # the copy takes the draft's place: no extra positions


CPromptLookup = _native.PromptLookup if _native is not None else None
LOOKUPS = [PromptLookup, CPromptLookup]  # the reference and its C twin (None where it was not built: those tests fail)


def test_the_c_rules_rows_use_the_c_lookup():
    assert CPromptLookup is not None, (
        "jfcore/decoding/rules/_lookup.c was not built: install a C compiler, pip install -e ."
    )
    assert type(NativeRules(DecodeConfig(method="ar", lookup_tokens=3), [], 0).new_row(0, [1]).lookup) is CPromptLookup


@pytest.mark.parametrize("PromptLookup", LOOKUPS, ids=["python", "c"])
def test_lookup_index_finds_the_latest_earlier_occurrence_of_the_longest_suffix(PromptLookup):
    lookup = PromptLookup(max_ngram=2, max_tokens=3, text=[1, 2, 3, 9, 2, 3, 4, 5, 7])
    assert lookup.propose(3, limit=10) == [4, 5, 7]  # (7, 3) never occurred; (3,) last followed by 4
    lookup.extend([3])
    assert lookup.propose(2, limit=10) == [3, 4, 5]  # (3, 2) never occurred: (2,) latest at index 4
    assert lookup.propose(2, limit=2) == [3, 4]
    assert PromptLookup(2, 3, [1, 2]).propose(8, 10) == []


@pytest.mark.parametrize("PromptLookup", LOOKUPS, ids=["python", "c"])
def test_a_repeating_pattern_gets_a_full_length_candidate(PromptLookup):
    """The latest match of "8 7" ends one token before the text does: the copy runs on through the known next
    token and itself."""
    assert PromptLookup(max_ngram=2, max_tokens=6, text=[7, 8, 7, 8]).propose(7, limit=10) == [8, 7, 8, 7, 8, 7]
    assert PromptLookup(max_ngram=3, max_tokens=4, text=[5, 5, 5]).propose(5, limit=10) == [5, 5, 5, 5]


@pytest.mark.parametrize("PromptLookup", LOOKUPS, ids=["python", "c"])
def test_candidate_length_grows_on_full_acceptance_and_shrinks_on_rejection(PromptLookup):
    lookup = PromptLookup(max_ngram=1, max_tokens=7)
    lookup.length = 3
    lookup.update(proposed=3, accepted=3)
    assert lookup.length == 5
    lookup.update(proposed=5, accepted=5)
    assert lookup.length == 7  # capped
    lookup.update(proposed=7, accepted=2)
    assert lookup.length == 6
    for _ in range(10):
        lookup.update(proposed=1, accepted=0)
    assert lookup.length == 1
    lookup.update(proposed=0, accepted=0)  # nothing proposed: nothing learnt
    assert lookup.length == 1


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    text=st.lists(st.integers(0, 4), max_size=40),
    max_ngram=st.integers(1, 5),
    max_tokens=st.integers(0, 9),
    steps=st.lists(st.tuples(st.integers(0, 4), st.integers(-1, 12), st.integers(0, 9)), min_size=1, max_size=12),
)
def test_the_c_lookup_proposes_and_adapts_like_the_python_one(text, max_ngram, max_tokens, steps):
    """Step after step the same candidate, length and text: texts over a 5-token vocabulary repeat, so matches of
    every length, overlaps with the end and copies that run on into themselves occur."""
    python, c = PromptLookup(max_ngram, max_tokens, text), CPromptLookup(max_ngram, max_tokens, text)
    for next_token, limit, accepted in steps:
        proposed = python.propose(next_token, limit)
        assert c.propose(next_token, limit) == proposed
        taken = min(accepted, len(proposed))
        for lookup in (python, c):
            lookup.update(len(proposed), taken)
            lookup.extend([next_token, *proposed[:taken]])
        assert (c.length, c.text) == (python.length, python.text)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lookup_tokens": -1}, "lookup_tokens must be >= 0"),
        ({"lookup_ngram": 0}, "lookup_ngram must be >= 1"),
        ({"record_trajectories": True, "lookup_tokens": 4}, "without prompt lookup"),
        ({"method": "ar", "lookup_tokens": 4, "lookup_within": True}, "lookup_within needs"),
        ({"block_size": 4, "lookup_within": True}, "lookup_within needs lookup_tokens > 0"),
    ],
)
def test_bad_lookup_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DecodeConfig(**kwargs)


def test_lookup_candidates_are_what_prompt_lookup_would_copy_at_each_response_token():
    # 6 follows the earlier 5; 7 follows the earlier 5 6; 5 follows the earlier 5 6 7 (the text says 9); nothing
    # earlier ends in 9; 6 follows the latest 5.
    assert lookup_candidates([5, 6, 7, 5], [6, 7, 9, 5, 6]) == [6, 7, 5, -1, 6]
