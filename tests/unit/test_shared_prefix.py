"""Rows whose prompts open alike share that prefix's KV, and still get exactly `generate(do_sample=False)`'s tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import MistralConfig, MistralForCausalLM

from jfcore.decoding import DecodeConfig, decode
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.runner.shared_prefix import Prefix, PrefixRows, attend, prefill, supported
from jfcore.decoding.scheduler import Scheduler
from tests.support.arrivals import run_arrivals
from tests.support.tiny_models import ARCHITECTURES, COMMON, LLAMA_LIKE, greedy_reference, position_model, tiny_model

MAX_NEW = 24
OPENINGS = [[7, 3, 9, 1, 4, 4, 2, 8, 8, 30, 31, 5], [60, 2, 2, 8, 9, 1, 33, 71, 5, 5]]


@functools.cache
def model(arch: str):
    return position_model() if arch == "position" else tiny_model(arch)


def live_batch(m, method: str, block_size: int = 4, share: int = 3) -> Scheduler:
    config = DecodeConfig(method=method, block_size=block_size, max_new_tokens=MAX_NEW, share_prefix_tokens=share)
    return Decoder(m, config, eos_token_ids=[], pad_token_id=0).scheduler()


suffix = st.lists(st.integers(0, 95), min_size=1, max_size=6)
arrival = st.tuples(st.sampled_from([0, 1, None]), suffix, st.integers(0, 5), st.integers(1, MAX_NEW))


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from([*ARCHITECTURES, "position"]),
    method=st.sampled_from(["ar", "jacobi", "multiblock"]),
    block_size=st.integers(2, 8),
    first=suffix,
    arrivals=st.lists(arrival, min_size=1, max_size=5),
    cancel=st.one_of(st.none(), st.integers(0, 5)),
)
def test_shared_prefixes_match_generate(arch, method, block_size, first, arrivals, cancel):
    """Two prompts opening alike start the batch; more, opening with one of two prefixes or neither, join it at
    any step: prefixes are made at admission or taken from a live row's cache, rows leave and are cancelled, and
    every row still gets its own greedy tokens; the KV the batch holds is always exactly each row's committed
    text."""
    m = model(arch)
    live = live_batch(m, method, block_size)
    events = []
    live.on_step = events.append
    opening = [(OPENINGS[0] + first, 0, MAX_NEW), (OPENINGS[0] + first + [7], 0, MAX_NEW)]
    later = [((OPENINGS[o] if o is not None else []) + s, at, n) for o, s, at, n in arrivals]

    def opening_is_shared(step: int) -> None:
        if step == 0:
            assert live.slots.shared.of_row[:2] == [0, 0]

    rows, cancelled = run_arrivals(live, opening + later, cancel, opening_is_shared)
    for row, (p, _, budget) in rows:
        if row is not cancelled:
            assert row.out == greedy_reference(m, p, budget), (p, budget)
    assert all(e.cache_tokens == e.committed for e in events)


@pytest.mark.parametrize("method", ["ar", "jacobi", "multiblock"])
def test_a_shared_prefix_is_held_once(method):
    """Rows opening with the same 12 tokens hold only their own tokens in their cache slots; the prefix is
    prefilled once and read by every row; a prefix taken from a live row's slots equals a fresh prefill."""
    m = model("llama")
    prompts = [OPENINGS[0] + [40 + i, 41, 42][: i + 1] for i in range(3)]
    live = live_batch(m, method)
    rows = live.add(prompts)
    assert live.slots.shared.of_row == [0, 0, 0]
    assert live.slots.shared.lengths == [12, 12, 12]
    assert live.slots.lengths().tolist() == [1, 2, 3]  # own slots: only what follows the prefix
    fresh = prefill(m, OPENINGS[0])
    held = live.slots.shared.prefixes[0]
    for mine, theirs in zip(held.keys + held.values, fresh.keys + fresh.values):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)

    alone = live_batch(m, method)
    first = alone.add([prompts[0]])
    assert alone.slots.shared is None  # nothing to share with yet
    second = alone.add([prompts[1]])
    assert alone.slots.shared.of_row == [-1, 0]  # the newcomer reads the live row's opening, copied from its slots
    donated = alone.slots.shared.prefixes[0]
    assert donated.tokens == tuple(OPENINGS[0])
    for mine, theirs in zip(donated.keys + donated.values, fresh.keys + fresh.values):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)

    for batch in (live, alone):
        while batch.rows:
            batch.step()
    expected = [greedy_reference(m, p, MAX_NEW) for p in prompts]
    assert [r.out for r in rows] == expected
    assert [r.out for r in first + second] == expected[:2]
    assert m.config._attn_implementation == "sdpa"  # the wrapping attention is only ever on inside a forward


def test_shared_prefix_and_sharing_off_agree_with_either_rules():
    """Many rows with the C rules and with the Python ones, with and without sharing, give the same tokens, equal
    to generate's."""
    m = model("qwen2")
    prompts = [OPENINGS[1] + [i % 90, (3 * i) % 90] for i in range(12)]
    runs = []
    for share in (0, 4):
        config = DecodeConfig(method="jacobi", block_size=4, max_new_tokens=MAX_NEW, share_prefix_tokens=share)
        runs += [Decoder(m, config, [], 0, rules=rules).decode(prompts).sequences for rules in ("native", "python")]
    assert runs == [[greedy_reference(m, p, MAX_NEW) for p in prompts]] * 4


def test_recorded_trajectories_do_not_depend_on_sharing():
    """Trajectory generation over prompts with one opening records the same states and fixed points whether the
    opening's KV is shared or not."""
    m = model("qwen2")
    prompts = [OPENINGS[0] + [i, i + 1] for i in range(10, 20)]
    runs = {}
    for share in (0, 4):
        config = DecodeConfig(
            method="jacobi", block_size=4, max_new_tokens=20, record_trajectories=True, share_prefix_tokens=share
        )
        events = []
        runs[share] = decode(m, prompts, config, eos_token_id=[], pad_token_id=0, on_step=events.append)
        assert all(e.cache_tokens == e.committed for e in events)
    assert runs[4].trajectories == runs[0].trajectories
    assert runs[4].sequences == runs[0].sequences == [greedy_reference(m, p, 20) for p in prompts]


def test_unsupported_attention_keeps_its_own_cache():
    """A model whose attention the shared softmax does not do is found out by the probe (eager attention: not the
    wrapped implementation; a sliding window: a variant the split softmax refuses) and decodes without sharing."""
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(**COMMON, **LLAMA_LIKE, sliding_window=3)).eval()
    assert not supported(windowed)
    eager = tiny_model("llama", attn="eager")
    assert not supported(eager)
    prompts = [OPENINGS[0] + [1], OPENINGS[0] + [2, 3]]
    live = live_batch(eager, "jacobi")
    rows = live.add(prompts)
    assert live.slots.shared is None
    while live.rows:
        live.step()
    assert [r.out for r in rows] == [greedy_reference(eager, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("of_row", [[0, 0], [0, -1]])
def test_attention_over_a_prefix_builds_its_tensors_on_the_inputs_device(mask, of_row):
    """On a GPU, a tensor the attention built on the CPU fails the forward. On the meta device any such tensor
    fails too, so this runs the attention's device handling without a GPU: every mask form the model's mask function
    gives (None: causal), a prefix every row reads and one that only some rows read."""
    meta = torch.device("meta")
    rows, heads, kv_heads, q, length, dim = 2, 4, 2, 3, 5, 8
    prefix = Prefix(
        (1, 2, 3, 4), [torch.empty(kv_heads, 4, dim, device=meta)], [torch.empty(kv_heads, 4, dim, device=meta)]
    )
    module = torch.nn.Module()
    module.layer_idx = 0
    if mask == "bool":
        mask = torch.ones(rows, 1, q, length, dtype=torch.bool, device=meta)
    elif mask == "additive":
        mask = torch.zeros(rows, 1, q, length, device=meta)
    query = torch.empty(rows, heads, q, dim, device=meta)
    key, value = (
        torch.empty(rows, kv_heads, length, dim, device=meta),
        torch.empty(rows, kv_heads, length, dim, device=meta),
    )
    out, _ = attend(module, query, key, value, mask, PrefixRows([prefix], of_row))
    assert out.device == meta and out.shape == (rows, q, heads, dim)


def test_share_prefix_tokens_is_checked():
    with pytest.raises(ValueError, match="share_prefix_tokens must be >= 0"):
        DecodeConfig(share_prefix_tokens=-1)
