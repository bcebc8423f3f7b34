"""Decoder invariants: every forward commits >= 1 token, the cache holds exactly the
committed text, and recorded trajectories obey the trajectory rules of docs/DESIGN.md, section 3."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from jfcore.decoding import DecodeConfig, StepEvent, decode
from jfcore.decoding.candidates.ngram_pool import NgramPool
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.rules.layout import tree_mask
from jfcore.decoding.rules.native import NativeRules, _native
from jfcore.decoding.rules.python import PythonRules
from jfcore.decoding.runner.kv_cache import SlotCache
from jfcore.decoding.runner.slots import SlotBatch
from tests.support.tiny_models import greedy_reference, position_model, tiny_model

PROMPTS = [[7, 3, 9, 1, 4, 4, 2], [5], [11, 12, 13], [60, 2, 2, 8, 9, 1, 33, 71, 5, 5, 19]]


def first_mismatch(state: list[int], fixed: list[int]) -> int:
    return next((i for i, (s, f) in enumerate(zip(state, fixed)) if s != f), len(fixed))


@pytest.mark.parametrize("model_name", ["llama", "gpt2", "position"])
@pytest.mark.parametrize("method,block_size", [("ar", 1), ("jacobi", 4), ("jacobi", 16), ("multiblock", 8)])
def test_each_forward_commits_and_cache_matches(model_name, method, block_size):
    m = position_model() if model_name == "position" else tiny_model(model_name)
    events: list[StepEvent] = []
    config = DecodeConfig(method=method, block_size=block_size, max_new_tokens=60)
    out = decode(m, PROMPTS, config, eos_token_id=[], pad_token_id=0, on_step=events.append)
    assert events and all(a >= 1 for e in events for a in e.accepted)
    for e in events:
        assert e.cache_tokens == e.committed  # prompt + committed tokens, nothing else
    # Each row's forwards commit its whole output, except at most the last token, which
    # the last forward's logits give and which is emitted without another forward.
    per_row = {}
    for e in events:
        for row, a in zip(e.rows, e.accepted):
            per_row[row] = per_row.get(row, 0) + a
    for row, sequence in enumerate(out.sequences):
        assert len(sequence) - 1 <= per_row[row] <= len(sequence)
    assert out.stats.decode_forwards == sum(len(e.rows) for e in events)
    assert out.stats.tpf == pytest.approx(sum(map(len, out.sequences)) / out.stats.decode_forwards)


@pytest.mark.parametrize("model_name", ["qwen2", "position"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_trajectories(model_name, block_size):
    m = position_model() if model_name == "position" else tiny_model(model_name)
    eos = greedy_reference(m, PROMPTS[0], 70)[41]
    config = DecodeConfig(block_size=block_size, max_new_tokens=70, record_trajectories=True)
    out = decode(m, PROMPTS, config, eos_token_id=eos, pad_token_id=0)
    assert out.trajectories is not None
    for prompt, sequence, blocks in zip(PROMPTS, out.sequences, out.trajectories):
        # Blocks tile the output, each a full block except possibly the last.
        assert [t for b in blocks for t in b.fixed_point] == sequence
        assert all(len(b.fixed_point) == block_size for b in blocks[:-1])
        assert [b.start for b in blocks] == [sum(len(x.fixed_point) for x in blocks[:i]) for i in range(len(blocks))]
        for block in blocks:
            fixed = block.fixed_point
            assert all(len(s) == len(fixed) and s[0] == fixed[0] for s in block.states)
            mismatches = [first_mismatch(s, fixed) for s in block.states]
            assert mismatches == sorted(mismatches) and mismatches[-1] == len(fixed)
        # The fixed point is the AR continuation of its context (checked with generate for a few blocks).
        for block in blocks[:: max(1, len(blocks) // 3)]:
            context = prompt + sequence[: block.start]
            assert greedy_reference(m, context, len(block.fixed_point)) == block.fixed_point


def test_untrained_jacobi_states_really_iterate():
    """On a model whose drafts converge in one update, a block takes two states."""
    out = decode(
        position_model(),
        [[3, 4]],
        DecodeConfig(block_size=8, max_new_tokens=32, record_trajectories=True),
        eos_token_id=[],
    )
    assert [len(b.states) for b in out.trajectories[0]] == [2, 2, 2, 2]


def test_cache_compaction_keeps_attention_exact():
    """Holes squeezed out of the cache change nothing the model sees."""
    m = tiny_model("llama")
    prompts = [[1, 2, 3, 4], [9]]

    def run(compact: bool) -> torch.Tensor:
        batch = SlotBatch(m, len(prompts), compact=compact)
        tokens = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 9]])
        valid = tokens != 0
        with torch.no_grad():
            batch.forward(tokens, valid, (valid.long().cumsum(1) - 1).clamp(min=0))
            batch.keep(valid)
            for step in range(12):  # the rows take turns keeping 7 or 1 of 8 new tokens: holes in both
                base = batch.lengths()
                draft = (torch.arange(8)[None].expand(2, -1) + 10 * step) % 96
                batch.forward(draft, torch.ones(2, 8, dtype=torch.bool), base[:, None] + torch.arange(8))
                keep = torch.zeros(2, 8, dtype=torch.bool)
                keep[step % 2, :7] = keep[1 - step % 2, :1] = True
                batch.keep(keep)
            slots = batch.num_slots
            base = batch.lengths()
            logits = batch.forward(torch.tensor([[5], [6]]), torch.ones(2, 1, dtype=torch.bool), base[:, None])
        return logits, slots

    compacted, compact_slots = run(True)
    reference, full_slots = run(False)
    assert compact_slots < full_slots
    torch.testing.assert_close(compacted, reference, rtol=1e-5, atol=1e-5)


def _filled_cache(m, stacked: bool, heads: list[int]) -> tuple[SlotCache, list[torch.Tensor]]:
    """A cache for `m` holding 4 rows x 6 slots of random keys (values: keys + 1) per layer, `heads[i]` KV heads
    in layer i; with `stacked` False its layers keep storage of their own."""
    cache = SlotCache(m.config)
    if not stacked:
        cache.stack.leave()
    generator = torch.Generator().manual_seed(0)
    written = [torch.randn(4, h, 6, 8, generator=generator) for h in heads]
    for layer, keys in zip(cache.layers, written):
        layer.update(keys, keys + 1)
    return cache, written


def test_one_stack_of_layers_moves_rows_and_slots_as_layers_of_their_own_do():
    """Rows leaving, slots moving and compaction give every layer the same keys and values whether the layers are
    views of one tensor (one operation for all) or keep their own storage (one per layer)."""
    m = tiny_model("llama")
    heads = [m.config.num_key_value_heads] * m.config.num_hidden_layers
    results = []
    for stacked in (True, False):
        cache, _ = _filled_cache(m, stacked, heads)
        assert (cache.stack is not None and cache.stack.whole) == stacked
        cache.keep_rows([3, 1, 0], torch.device("cpu"))  # row 3 takes row 0's place, row 0 row 2's
        cache.move_slots(torch.tensor([0, 2]), torch.tensor([5, 4]), torch.tensor([1, 2]))
        cache.gather_slots(torch.tensor([[0, 2, 5], [1, 3, 4], [0, 1, 2]]))
        results.append([t.clone() for layer in cache.layers for t in (layer.keys, layer.values)])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[0][0].shape == (3, heads[0], 3, 8)


def test_a_layer_of_another_shape_gives_every_layer_storage_of_its_own():
    """The stack needs one shape for every layer: a layer with other KV heads makes the layers keep storage of their
    own, with what they held, and the cache's operations go layer by layer."""
    m = tiny_model("llama")
    heads = [2] + [4] * (m.config.num_hidden_layers - 1)
    cache, written = _filled_cache(m, True, heads)
    assert cache.stack.k is None and all(layer.stack is None for layer in cache.layers)
    assert all(
        torch.equal(layer.keys, keys) and torch.equal(layer.values, keys + 1)
        for layer, keys in zip(cache.layers, written)
    )
    cache.keep_rows([2], torch.device("cpu"))
    assert all(torch.equal(layer.keys, keys[2:3]) for layer, keys in zip(cache.layers, written))


CNgramPool = _native.NgramPool if _native is not None else None
POOLS = [NgramPool, CNgramPool]  # the reference and its C twin (None where it was not built: those tests fail)


def test_the_c_rules_rows_use_the_c_pool_and_the_python_rules_rows_the_python_one():
    """The install builds the C pool where a C compiler is at hand (pyproject.toml); without one it goes on with the
    Python pool and rules, and this test says so."""
    assert CNgramPool is not None, (
        "jfcore/decoding/rules/_ngram.c was not built: install a C compiler, pip install -e ."
    )
    config = DecodeConfig(method="multiblock", pool_size=4)
    assert type(NativeRules(config, [], 0).new_row(0, [1]).pool) is CNgramPool
    assert type(PythonRules(config, [], 0).new_row(0, [1]).pool) is NgramPool


@pytest.mark.parametrize("pool_class", POOLS, ids=["python", "c"])
def test_ngram_pool_keeps_recent_distinct_continuations(pool_class):
    pool = pool_class(size=2, ngram_size=3)
    pool.add([1, 2, 3, 4])
    pool.add([1, 5, 6])
    pool.add([1, 2, 3])
    assert pool.candidates(1, max_len=5) == [(2, 3), (5, 6)]
    assert pool.candidates(2, max_len=1) == [(3,)]
    assert pool.candidates(99, max_len=5) == []


class MoveToFrontPool:
    """The pool's rule done eagerly: every added n-gram goes to the front of its first token's list (moved there if
    present), and each list keeps its first `size`."""

    def __init__(self, size: int, ngram_size: int):
        self.size, self.span, self.table = size, ngram_size - 1, {}

    def add(self, tokens: list[int]) -> None:
        for i in range(len(tokens) - 1):
            gram = tuple(tokens[i + 1 : i + 1 + self.span])
            entries = self.table.setdefault(tokens[i], [])
            if gram in entries:
                entries.remove(gram)
            entries.insert(0, gram)
            del entries[self.size :]

    def candidates(self, first: int, max_len: int) -> list[tuple[int, ...]]:
        cut = [gram[:max_len] for gram in self.table.get(first, ())]
        return [gram for i, gram in enumerate(cut) if gram and gram not in cut[:i]]


@pytest.mark.parametrize("pool_class", POOLS, ids=["python", "c"])
def test_ngram_pool_reads_what_eager_move_to_front_lists_hold(pool_class):
    """The pool records occurrences and builds a first token's list when it is read, dropping what can no longer be
    read: over random adds and reads (few tokens, so continuations repeat and lists overflow; large token ids too)
    it must answer every read as the eager lists do."""
    rng = random.Random(0)
    for _ in range(2000):
        size, ngram_size, vocab = rng.randrange(0, 6), rng.randrange(2, 9), rng.randrange(2, 12)
        base = rng.choice([0, 150_000, 2**31 - 20])
        pool, eager = pool_class(size, ngram_size), MoveToFrontPool(size, ngram_size)
        for _ in range(rng.randrange(1, 60)):
            if rng.random() < 0.6:
                tail = [base + rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
                pool.add(tail)
                eager.add(tail)
            else:
                first, max_len = base + rng.randrange(vocab), rng.randrange(0, 10)
                assert pool.candidates(first, max_len) == eager.candidates(first, max_len)


def test_the_c_pool_says_what_it_cannot_hold():
    pool = CNgramPool(4, 4)
    with pytest.raises(ValueError, match="token ids must be in"):
        pool.add([1, -2, 3])
    with pytest.raises(TypeError, match="sequence of token ids"):
        pool.add(5)
    pool.add([1, 2, 3])  # a failed add recorded nothing
    assert pool.candidates(1, 5) == [(2, 3)]
    with pytest.raises(ValueError, match="size >= 0"):
        CNgramPool(-1, 4)


@pytest.mark.parametrize(
    "draft,candidates,pred,kept,recycled",
    [
        # Both candidates verify two tokens after draft[0] (the draft only its first): the first of them wins.
        ([7, 1, 1, 1], [(4, (2, 3)), (6, (2, 4))], [2, 0, 0, 0, 3, 0, 4, 0], [0, 4, 5], 2),
        # A strictly longer run wins, wherever its candidate lies.
        ([7, 1, 1, 1], [(4, (2, 3)), (6, (2, 4))], [2, 0, 0, 0, 0, 0, 4, 0], [0, 6, 7], 2),
        # The draft's own run of 3 ties the candidate's 1 + 2: the draft wins, nothing is recycled.
        ([7, 2, 3, 1], [(4, (2, 5))], [2, 3, 9, 0, 5, 0], [0, 1, 2], 0),
    ],
)
def test_the_longest_verified_run_wins_and_the_earliest_wins_a_tie(draft, candidates, pred, kept, recycled):
    """The acceptance rule of docs/DESIGN.md, section 7: the longest of the draft's verified run and each
    candidate's (draft[0], then the candidate), the draft first and then the candidates in order on a tie."""
    config = DecodeConfig(method="multiblock", block_size=4, num_blocks=1, pool_size=4, ngram_size=3)
    rules = PythonRules(config, [], 0)
    row = rules.new_row(0, [1, 2, 3])
    row.blocks, row.sizes = [list(draft)], [len(draft)]
    inputs = draft + [t for _, gram in candidates for t in gram]
    slots = rules._verify(row, pred, candidates, draft)
    assert slots == kept
    assert row.out == [inputs[s] for s in kept] and row.verified == len(kept)
    assert row.recycled == recycled
    assert row.blocks[0][0] == pred[kept[-1]]  # the next draft opens with the token after the committed ones


class GivenCandidates:
    """A pool whose every read gives the same candidates."""

    def __init__(self, grams: list[tuple[int, ...]]):
        self.grams = grams

    def candidates(self, first: int, max_len: int) -> list[tuple[int, ...]]:
        return list(self.grams)


def test_the_candidate_tree_shows_each_query_its_own_branch_and_hides_padding():
    """docs/DESIGN.md, section 7: a draft query sees the draft up to itself; a candidate's query sees the draft's
    first token and its candidate up to itself; no query sees row padding. Random layouts, checked against that
    rule written out per query, on the decoder's own layout: offsets from draft[0], each candidate restarting at 1."""
    rng = random.Random(0)
    rules = PythonRules(DecodeConfig(method="multiblock", pool_size=4), [], 0)
    for _ in range(200):
        rows = []
        for _ in range(rng.randrange(1, 5)):
            draft = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 7))]
            grams = [tuple(rng.randrange(1, 50) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(4))]
            row = rules.new_row(0, [1, 2])
            row.blocks, row.sizes = [draft], [len(draft)]
            row.pool = GivenCandidates(grams)
            inputs, offsets, cands = rules._layout(row)
            branch = [0] * (cands[0][0] if cands else len(inputs))  # 0: the draft, i: the i-th candidate
            for i, (_, gram) in enumerate(cands, start=1):
                branch += [i] * len(gram)
            rows.append((offsets, branch))
        width = max(len(offsets) for offsets, _ in rows)
        tree = tree_mask(torch.tensor([o + [0] * (width - len(o)) for o, _ in rows]), torch.device("cpu"))
        for b, (offsets, branch) in enumerate(rows):
            n = len(offsets)
            for i in range(width):
                for j in range(width):
                    if j >= n:
                        expected = False  # padding is seen by no one
                    elif i >= n:
                        continue  # what padding sees is never read
                    else:
                        expected = j <= i and (branch[j] == branch[i] or j == 0)
                    assert bool(tree[b, i, j]) == expected, (offsets, branch, i, j)


def test_stops_at_first_eos_and_max_new_tokens():
    m = tiny_model("mistral")
    ref = greedy_reference(m, [4, 5, 6], 40)
    eos = ref[12]
    first = ref.index(eos)
    for config in [DecodeConfig(method="ar"), DecodeConfig(block_size=32), DecodeConfig(method="multiblock")]:
        out = decode(m, [[4, 5, 6]], config, eos_token_id=eos, pad_token_id=0)
        assert out.sequences == [ref[: first + 1]]
    for max_new in [1, 2, 7]:
        out = decode(m, [[4, 5, 6]], DecodeConfig(block_size=4, max_new_tokens=max_new), eos_token_id=[])
        assert out.sequences == [ref[:max_new]]


def test_stats_are_consistent():
    out = decode(tiny_model("gpt2"), PROMPTS, DecodeConfig(method="ar", max_new_tokens=20), eos_token_id=[])
    s = out.stats
    assert s.new_tokens == 80 and s.decode_forwards == 4 * 19 and s.forward_calls == 19
    assert 0 < s.forward_seconds <= s.decode_seconds and 0 <= s.overhead < 1
    assert s.tps == pytest.approx(s.new_tokens / (s.prefill_seconds + s.decode_seconds))
    assert set(s.as_dict()) >= {"tpf", "tps", "decode_tps", "overhead", "new_tokens", "decode_forwards"}


def test_promoted_block_keeps_its_progress():
    """When acceptance runs past block 0 into block 1, block 1 is promoted with its verified
    tokens committed and the rest of its draft updated, not restarted from filler."""
    from jfcore.decoding.row import Row

    config = DecodeConfig(method="multiblock", block_size=4, num_blocks=2, pool_size=0, max_new_tokens=100)
    rules = PythonRules(config, eos_token_ids=[], pad_token_id=0)
    row = Row(0, [1, 2, 3], 100, out=[8, 9], blocks=[[10, 11], [12, 13, 14, 15]], sizes=[4, 4], done=2)
    # The model confirms 11 and 12 (crossing into block 1) and rejects 13, predicting 40 instead.
    predictions = [11, 12, 40, 50, 51, 52]
    kept = rules._verify(row, predictions, cands=[], draft=row.draft)
    assert kept == [0, 1, 2]
    assert row.out == [8, 9, 10, 11, 12]
    assert row.blocks == [[40, 50, 51]] and row.sizes == [4] and row.done == 1


def test_pseudo_active_block_spawns_from_the_model_guess():
    from jfcore.decoding.row import Row

    config = DecodeConfig(
        method="multiblock", block_size=4, num_blocks=2, pool_size=0, max_new_tokens=100, spawn_ratio=0.75
    )
    rules = PythonRules(config, eos_token_ids=[], pad_token_id=0)
    rules.vocab_size = 96
    row = Row(0, [1, 2, 3], 100, out=[], blocks=[[10, 11, 12, 13]], sizes=[4], rng=random.Random(0))
    # 10, 11, 12 accepted (3 of 4 >= 0.75 * 4): a second block opens with the model's token after the draft.
    rules._verify(row, [11, 12, 30, 77], cands=[], draft=row.draft)
    assert row.out == [10, 11, 12]
    assert row.blocks[0] == [30] and row.blocks[1][0] == 77 and len(row.blocks[1]) == 4


def test_empty_prompts_are_refused():
    m = tiny_model("llama")
    for prompts in ([], [[1, 2], []]):
        with pytest.raises(ValueError, match="every prompt at least one token"):
            decode(m, prompts, DecodeConfig(), eos_token_id=[])


def test_trajectories_do_not_depend_on_the_batch():
    """Drafts are seeded per prompt, so batching changes no recorded state (trajectories are training data)."""
    m = tiny_model("gpt2")
    config = DecodeConfig(block_size=6, max_new_tokens=30, record_trajectories=True, seed=3)
    batched = decode(m, PROMPTS, config, eos_token_id=[]).trajectories
    alone = [decode(m, [p], config, eos_token_id=[]).trajectories[0] for p in PROMPTS]
    assert batched == alone
    assert any(len(b.states) > 1 for blocks in alone for b in blocks)


def test_the_garbage_collector_is_off_while_a_decode_steps_and_as_it_was_after():

    enabled: list[bool] = []
    config = DecodeConfig(method="multiblock", block_size=4, max_new_tokens=12)
    decoder = Decoder(tiny_model("llama"), config, [], 0, on_step=lambda _: enabled.append(gc.isenabled()))
    assert gc.isenabled()
    decoder.decode([[1, 2, 3], [4, 5]])
    assert enabled and not any(enabled)
    assert gc.isenabled()
    gc.disable()
    try:
        decoder.decode([[1, 2, 3]])
        assert not gc.isenabled()  # a caller's own choice stands
    finally:
        gc.enable()
