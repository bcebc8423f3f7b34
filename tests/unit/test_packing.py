"""Packing trajectories into training sequences (docs/DESIGN.md, sections 4 and 5): the packing invariants on
real trajectories of a tiny random model, the noise schedule, max_length, stats, and the inputs
that must be refused with a clear message."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jfcore.config import ConfigError, from_dict
from jfcore.contracts import PACKED_SCHEMA
from jfcore.decoding import DecodeConfig, decode
from jfcore.packing import (
    PackingConfig,
    PackingError,
    block_target,
    choose_state,
    is_heldout,
    noise_level,
    pack_shards,
)
from jfcore.trajectories import rows_to_table, trajectory_rows
from tests.support.tiny_models import tiny_model

N = 8
PROMPTS = [[7, 3, 9, 1, 4, 4, 2], [5], [11, 12, 13], [60, 2, 2, 8, 9, 1, 33, 71, 5, 5, 19]]
# Four full blocks and a last block of 5 tokens, so the padding of short last blocks is exercised.
MAX_NEW = 37
LAST = MAX_NEW % N


def trajectories(block_size: int, max_new_tokens: int, prompts=PROMPTS, tokenizer="tok-fp"):
    model = tiny_model("qwen2")  # random weights: blocks take several Jacobi states to converge
    config = DecodeConfig(block_size=block_size, max_new_tokens=max_new_tokens, record_trajectories=True)
    out = decode(model, prompts, config, eos_token_id=[], pad_token_id=0)
    rows = {
        f"p{i}": trajectory_rows(f"p{i}", p, seq, blocks, block_size, "model-fp", tokenizer)
        for i, (p, seq, blocks) in enumerate(zip(prompts, out.sequences, out.trajectories))
    }
    return out, rows


@pytest.fixture(scope="module")
def decoded():
    return trajectories(N, MAX_NEW)


def write(path: Path, rows: list[dict]) -> Path:
    pq.write_table(rows_to_table(rows), path)
    return path


@pytest.fixture
def shards(tmp_path, decoded):
    """Every prompt's blocks split across two shards (even blocks / odd blocks reversed), listed odd first."""
    rows = [r for rs in decoded[1].values() for r in rs]
    even = write(tmp_path / "even.parquet", [r for r in rows if r["block_index"] % 2 == 0])
    odd = write(tmp_path / "odd.parquet", [r for r in rows if r["block_index"] % 2 == 1][::-1])
    return [odd, even]


def pack(paths, out_dir: Path, **config):
    stats = pack_shards(paths, out_dir, PackingConfig(**config))
    table = pa.concat_tables([pq.read_table(out_dir / name) for name in stats.shards])
    assert table.schema == PACKED_SCHEMA
    return stats, table


def first_mismatch(state, fixed):
    return next((i for i, (s, f) in enumerate(zip(state, fixed)) if s != f), len(fixed))


def brute_force_choice(states, fixed, target):
    """argmin |noise - target|; ties to the noisier, then the earlier state."""
    noise = [(len(fixed) - first_mismatch(s, fixed)) / len(fixed) for s in states]
    return min(range(len(states)), key=lambda i: (round(abs(noise[i] - target), 9), -noise[i], i))


def blocks_of(seq):
    """(k_j, l_j, positions of k_j, positions of l_j) for every block of a packed row."""
    P, n, ids, pos = seq["prompt_length"], seq["block_size"], seq["input_ids"], seq["position_ids"]
    for j in range(seq["num_blocks"]):
        k, l = P + 2 * j * n, P + 2 * j * n + n
        yield ids[k : k + n], ids[l : l + n], pos[k : k + n], pos[l : l + n]


def test_noise_level_and_choice_with_ties():
    assert (noise_level(8, 8), noise_level(2, 8), noise_level(0, 4)) == (0.0, 0.75, 1.0)
    mismatches = [1, 2, 4, 4, 8]  # noise 7/8, 6/8, 4/8, 4/8 (two states), 0
    assert choose_state(mismatches, 8, 0.0) == 4  # t = 0 selects the fixed point
    assert choose_state(mismatches, 8, 13 / 16) == 0  # midway between 7/8 and 6/8: the noisier
    assert choose_state(mismatches, 8, 0.25) == 2  # midway between 4/8 and 0: the noisier, earlier of two
    # 0.3 is midway between 2/5 and 1/5, but in floats |0.4 - 0.3| > |0.2 - 0.3|: still a tie.
    assert choose_state([1, 2, 3, 4, 5], 5, 0.3) == 2
    for t in (Fraction(i, 64) for i in range(65)):  # exact brute force over a grid that hits every tie
        noise = [Fraction(8 - d, 8) for d in mismatches]
        best = min(abs(x - t) for x in noise)
        nearest = [i for i, x in enumerate(noise) if abs(x - t) == best]
        expected = min(nearest, key=lambda i: (-noise[i], i))
        assert choose_state(mismatches, 8, float(t)) == expected


@pytest.mark.parametrize("strategy", ["progressive", "random"])
def test_packed_sequences_hold_the_invariants(tmp_path, decoded, shards, strategy):
    out, rows = decoded
    config = {"strategy": strategy, "window": 3, "pad_token_id": 95}
    stats, table = pack(shards, tmp_path / "packed", **config)
    assert table.column("prompt_id").to_pylist() == sorted(rows)
    for seq in table.to_pylist():
        i = int(seq["prompt_id"][1:])
        blocks = rows[seq["prompt_id"]]
        P, T = len(PROMPTS[i]), len(blocks)
        assert (seq["prompt_length"], seq["block_size"], seq["num_blocks"]) == (P, N, T)
        assert len(seq["input_ids"]) == len(seq["position_ids"]) == P + 2 * T * N
        assert seq["input_ids"][:P] == PROMPTS[i] and seq["position_ids"][:P] == list(range(P))
        assert seq["valid_lengths"] == [N] * (T - 1) + [LAST]
        clean = []
        for j, (k, l, k_pos, l_pos) in enumerate(blocks_of(seq)):
            assert k_pos == l_pos == list(range(P + j * N, P + (j + 1) * N))
            states, fixed, m = blocks[j]["states"], blocks[j]["fixed_point"], seq["valid_lengths"][j]
            assert l == fixed + [95] * (N - m) and k[m:] == [95] * (N - m)
            target = block_target(PackingConfig(**config), seq["prompt_id"], j, T)
            assert k[:m] == states[brute_force_choice(states, fixed, target)]
            d = seq["first_mismatch"][j]
            assert d == first_mismatch(k[:m], fixed)
            assert seq["noise_levels"][j] == pytest.approx((m - d) / m)
            clean += l[:m]
        assert clean == out.sequences[i]  # the clean blocks are exactly the greedy response
    # The selection was really exercised: multi-state trajectories, and noisy states chosen.
    assert max(len(b["states"]) for bs in rows.values() for b in bs) > 2
    assert stats.consistency_blocks > 0
    if strategy == "progressive":  # targets 0, 0.5, 1: every third block is its fixed point
        assert stats.consistency_blocks < stats.blocks


def test_zero_noise_selects_the_fixed_point(tmp_path, shards):
    stats, table = pack(shards, tmp_path / "packed", min_noise=0.0, max_noise=0.0)
    for seq in table.to_pylist():
        assert all(k == l for k, l, _, _ in blocks_of(seq))
        assert seq["first_mismatch"] == seq["valid_lengths"] and set(seq["noise_levels"]) == {0.0}
    assert stats.consistency_blocks == 0 and stats.noise_histogram[0] == stats.blocks


def test_progressive_targets_cycle_with_period_w():
    config = PackingConfig(window=4, min_noise=0.2, max_noise=0.8)
    targets = [block_target(config, "any", k, 12) for k in range(12)]
    assert targets[:4] == pytest.approx(np.linspace(0.2, 0.8, 4).tolist())
    assert targets[:4] == targets[4:8] == targets[8:] and targets[3] == 0.8
    assert [block_target(config, "other", k, 12) for k in range(12)] == targets
    assert block_target(PackingConfig(window=1, min_noise=0.3, max_noise=0.9), "any", 5, 12) == 0.3


def test_a_response_shorter_than_the_window_gets_the_whole_ramp(tmp_path, decoded, shards):
    config = PackingConfig(window=16)  # every prompt here has 5 blocks
    assert [block_target(config, "any", k, 5) for k in range(5)] == pytest.approx([0, 0.25, 0.5, 0.75, 1])
    assert [block_target(config, "any", k, 1) for k in range(1)] == [0.0]
    _, table = pack(shards, tmp_path / "packed", window=16)
    for seq in table.to_pylist():  # the ramp reaches noisy states (a fixed window of 16 would stop at 4/15)
        assert seq["noise_levels"][0] == 0 and max(seq["noise_levels"]) >= 0.75


def test_random_targets_are_seeded_and_independent_of_shard_order(tmp_path, shards):
    config = {"strategy": "random", "min_noise": 0.2, "max_noise": 0.6}
    targets = [block_target(PackingConfig(**config), f"p{i}", k, 5) for i in range(4) for k in range(5)]
    assert all(0.2 <= t <= 0.6 for t in targets) and len(set(targets)) == len(targets)
    assert targets == [block_target(PackingConfig(**config), f"p{i}", k, 5) for i in range(4) for k in range(5)]
    assert targets != [block_target(PackingConfig(**config, seed=1), f"p{i}", k, 5) for i in range(4) for k in range(5)]
    _, a = pack(shards, tmp_path / "a", strategy="random")
    _, b = pack(shards[::-1], tmp_path / "b", strategy="random")
    _, c = pack(shards, tmp_path / "c", strategy="random", seed=1)
    assert a.equals(b) and not a.equals(c)


@pytest.mark.parametrize("max_length,skipped", [(40, 0), (20, 2)])
def test_max_length_drops_whole_blocks_from_the_end(tmp_path, decoded, shards, max_length, skipped):
    out, rows = decoded
    stats, table = pack(shards, tmp_path / "packed", max_length=max_length)
    assert stats.skipped == skipped and stats.sequences == len(PROMPTS) - skipped
    for seq in table.to_pylist():
        i = int(seq["prompt_id"][1:])
        P = len(PROMPTS[i])
        T = (max_length - P) // (2 * N)
        assert 1 <= seq["num_blocks"] == T < len(rows[seq["prompt_id"]])
        assert len(seq["input_ids"]) == P + 2 * T * N <= max_length
        clean = [t for (_, l, _, _), m in zip(blocks_of(seq), seq["valid_lengths"]) for t in l[:m]]
        assert clean == out.sequences[i][: T * N]
    kept = [len(rows[p]) for p in table.column("prompt_id").to_pylist()]
    assert stats.dropped_blocks == sum(kept) - stats.blocks > 0
    twice, table = pack(shards, tmp_path / "twice", max_length=max_length, samples_per_prompt=2)
    kept = [len(rows[p]) for p in table.column("prompt_id").to_pylist()]  # every sequence drops its own blocks
    assert twice.dropped_blocks == sum(kept) - twice.blocks == 2 * stats.dropped_blocks
    with pytest.raises(PackingError, match="no prompt fits max_length=10"):
        pack_shards(shards, tmp_path / "none", PackingConfig(max_length=10))


def test_stats_and_output_files(tmp_path, shards):
    out_dir = tmp_path / "packed"
    stats, table = pack(shards, out_dir, window=4, sequences_per_shard=1)
    assert stats.shards == [f"packed-{i:05d}.parquet" for i in range(4)]
    assert pq.read_metadata(out_dir / stats.shards[0]).row_group(0).column(0).compression == "ZSTD"
    seqs = table.to_pylist()
    assert stats.sequences == len(seqs) and stats.tokens == sum(len(s["input_ids"]) for s in seqs)
    assert stats.blocks == sum(s["num_blocks"] for s in seqs) == sum(stats.noise_histogram)
    noisy = sum(d < m for s in seqs for d, m in zip(s["first_mismatch"], s["valid_lengths"]))
    assert 0 <= stats.consistency_share <= 1 and stats.consistency_share == noisy / stats.blocks
    levels = [x for s in seqs for x in s["noise_levels"]]
    assert stats.noise_histogram == np.histogram(levels, bins=10, range=(0, 1))[0].tolist()
    written = json.loads((out_dir / "stats.json").read_text())
    assert written["config"]["window"] == 4 and written["tokenizer_fingerprint"] == "tok-fp"
    assert {k: written[k] for k in stats.as_dict()} == stats.as_dict()
    # Re-packing into the same folder with fewer shards leaves no stale shard behind.
    stats2 = pack_shards(shards, out_dir, PackingConfig(window=4))
    assert sorted(p.name for p in out_dir.glob("packed-*")) == stats2.shards == ["packed-00000.parquet"]
    assert not list(out_dir.glob(".*"))  # no temp files left


def test_config_is_strict():
    assert from_dict(PackingConfig, {"strategy": "random", "window": 4}).window == 4
    with pytest.raises(ConfigError, match="unknown key 'windw'"):
        from_dict(PackingConfig, {"windw": 4})
    with pytest.raises(ConfigError, match="'reverse' is not one of"):
        from_dict(PackingConfig, {"strategy": "reverse"})
    with pytest.raises(ConfigError, match="min_noise <= max_noise"):
        PackingConfig(min_noise=0.6, max_noise=0.5)
    with pytest.raises(ConfigError, match="window"):
        PackingConfig(window=0)


def test_refuses_empty_input(tmp_path):
    out = tmp_path / "packed"
    with pytest.raises(PackingError, match="no trajectory shards"):
        pack_shards([], out, PackingConfig())
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(PackingError, match="no trajectory shards"):
        pack_shards([tmp_path / "empty_dir"], out, PackingConfig())
    with pytest.raises(PackingError, match="not found: .*nope.parquet"):
        pack_shards([tmp_path / "nope.parquet"], out, PackingConfig())
    empty = write(tmp_path / "empty.parquet", [])
    with pytest.raises(PackingError, match="hold no rows: .*empty.parquet"):
        pack_shards([empty], out, PackingConfig())
    assert not out.exists()


def test_refuses_mixed_block_sizes(tmp_path, shards):
    _, rows = trajectories(4, 8, PROMPTS[:1])
    other = write(tmp_path / "n4.parquet", rows["p0"])
    with pytest.raises(PackingError) as err:
        pack_shards([*shards, other], tmp_path / "packed", PackingConfig())
    message = str(err.value)
    assert "mixed block sizes" in message and "n=8" in message and "n=4" in message
    assert shards[0].name in message and "n4.parquet" in message


def test_refuses_another_tokenizer(tmp_path, decoded, shards):
    with pytest.raises(PackingError) as err:
        pack_shards(shards, tmp_path / "packed", PackingConfig(expected_tokenizer_fingerprint="tok-other"))
    message = str(err.value)
    assert shards[0].name in message and "'tok-fp'" in message and "'tok-other'" in message
    assert "regenerate the trajectories" in message
    # Shards that disagree among themselves are refused even with no configured fingerprint.
    foreign = write(tmp_path / "foreign.parquet", [dict(r, tokenizer_fingerprint="tok-b") for r in decoded[1]["p0"]])
    with pytest.raises(PackingError, match="mixed tokenizers: .*'tok-b' in .*foreign.parquet"):
        pack_shards([*shards, foreign], tmp_path / "packed", PackingConfig())


def test_refuses_truncated_file(tmp_path, shards):
    data = shards[0].read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackingError, match="truncated.parquet: cannot read this Parquet file"):
        pack_shards([shards[1], truncated], tmp_path / "packed", PackingConfig())


def test_refuses_missing_column(tmp_path, shards):
    path = tmp_path / "no_states.parquet"
    pq.write_table(pq.read_table(shards[0]).drop_columns(["states"]), path)
    with pytest.raises(PackingError, match="no_states.parquet: not a trajectory shard: missing column.* states"):
        pack_shards([path], tmp_path / "packed", PackingConfig())


@pytest.mark.parametrize(
    "edit,problem",
    [
        (lambda rows: rows[:2] + rows[3:], "missing or duplicated"),
        (lambda rows: rows + rows[1:2], "missing or duplicated"),
        (lambda rows: rows[:-1], "last_block"),
        (lambda rows: rows[:2] + [dict(rows[2], context=rows[2]["context"][:-1] + [-1])] + rows[3:], "context"),
        (lambda rows: rows[:1] + [dict(rows[1], states=rows[1]["states"][:-1])] + rows[2:], "end at the fixed"),
    ],
)
def test_refuses_inconsistent_prompt_rows(tmp_path, decoded, edit, problem):
    path = write(tmp_path / "bad.parquet", edit(decoded[1]["p0"]))
    with pytest.raises(PackingError, match=f"prompt 'p0': .*{problem}"):
        pack_shards([path], tmp_path / "packed", PackingConfig())


def test_streaming_packing_equals_packing_in_memory(tmp_path, monkeypatch):
    """Many prompts, each prompt's blocks spread over every shard, several spill buckets and output shards:
    row for row what grouping everything in memory gives."""
    import jfcore.packing
    from tests.support.packing_reference import pack_in_memory

    prompts = [[(7 * i + j) % 90 + 1 for j in range(1 + i % 9)] for i in range(23)]
    _, rows = trajectories(4, 13, prompts=prompts)
    everything = [r for rs in rows.values() for r in rs]
    files = [write(tmp_path / f"shard-{s}.parquet", everything[s::3]) for s in range(3)]  # blocks round-robin
    monkeypatch.setattr(jfcore.packing, "PROMPTS_PER_BUCKET", 4)  # six buckets, not one
    monkeypatch.setattr(jfcore.packing, "SPILL_BATCH_ROWS", 5)
    for config in (PackingConfig(sequences_per_shard=5), PackingConfig(strategy="random", max_length=30)):
        stats = pack_shards(files, tmp_path / "out", config)
        expected = pack_in_memory(files, config)
        assert len(stats.shards) == len(expected) > (1 if config.max_length is None else 0)
        for name, table in zip(stats.shards, expected):
            assert pq.read_table(tmp_path / "out" / name).to_pylist() == table.to_pylist()
        assert not list((tmp_path / "out").glob(".spill-*"))


def test_heldout_prompts_are_whole_seeded_and_packed_apart(tmp_path, shards):
    stats, table = pack(shards, tmp_path / "packed", heldout_fraction=0.5, heldout_seed=3)
    held = sorted(stats.heldout_prompts)
    assert 0 < len(held) < len(PROMPTS)  # this seed splits the four prompts
    assert held == [
        p
        for p in (f"p{i}" for i in range(len(PROMPTS)))
        if is_heldout(PackingConfig(heldout_fraction=0.5, heldout_seed=3), p)
    ]
    trained = table.column("prompt_id").to_pylist()
    assert sorted(trained + held) == sorted(f"p{i}" for i in range(len(PROMPTS))) and not set(trained) & set(held)
    heldout_stats = json.loads((tmp_path / "packed" / "heldout" / "stats.json").read_text())
    heldout_rows = pa.concat_tables(
        [pq.read_table(tmp_path / "packed" / "heldout" / n) for n in heldout_stats["shards"]]
    )
    assert sorted(heldout_rows.column("prompt_id").to_pylist()) == held  # whole prompts, packed like the rest
    assert json.loads((tmp_path / "packed" / "stats.json").read_text())["heldout_prompts"] == stats.heldout_prompts
    assert stats.sequences == len(trained) and heldout_stats["sequences"] == len(held)
    # The choice is the prompt id's alone: another shard order and a subset of the prompts keep each on its side.
    again, _ = pack(shards[::-1], tmp_path / "again", heldout_fraction=0.5, heldout_seed=3)
    assert again.heldout_prompts == stats.heldout_prompts
    other, _ = pack(shards, tmp_path / "other", heldout_fraction=0.5, heldout_seed=4)
    assert other.heldout_prompts != stats.heldout_prompts
    # Repacked without a held-out share, the folder holds no stale held-out set.
    pack(shards, tmp_path / "packed")
    assert not (tmp_path / "packed" / "heldout").exists()
    with pytest.raises(PackingError, match="every packed prompt .* is held out: lower heldout_fraction"):
        pack_shards(shards, tmp_path / "all", PackingConfig(heldout_fraction=0.999999))


def test_samples_per_prompt_packs_each_trained_prompt_with_other_noisy_states(tmp_path, shards):
    one, single = pack(shards, tmp_path / "one", heldout_fraction=0.5, heldout_seed=3)
    three, table = pack(shards, tmp_path / "three", heldout_fraction=0.5, heldout_seed=3, samples_per_prompt=3)
    assert three.heldout_prompts == one.heldout_prompts  # held-out prompts: one sequence each, as before
    held = json.loads((tmp_path / "three" / "heldout" / "stats.json").read_text())["sequences"]
    assert held == len(one.heldout_prompts) and three.sequences == 3 * one.sequences
    rows = table.to_pylist()
    for prompt_id in {r["prompt_id"] for r in rows}:
        samples = [r for r in rows if r["prompt_id"] == prompt_id]
        assert len(samples) == 3
        first = next(r for r in single.to_pylist() if r["prompt_id"] == prompt_id)
        assert samples[0] == first  # sample 0 is the single-sample packing
        # the same text under other noise: the clean blocks agree, the chosen states do not all agree
        assert all([l for _, l, _, _ in blocks_of(s)] == [l for _, l, _, _ in blocks_of(first)] for s in samples)
        assert len({tuple(s["first_mismatch"]) for s in samples}) > 1
    config = PackingConfig(window=4)
    assert [block_target(config, "any", k, 12, sample=1) for k in range(4)] == pytest.approx([1 / 3, 2 / 3, 1, 0])
    with pytest.raises(ConfigError, match="samples_per_prompt must be >= 1"):
        from_dict(PackingConfig, {"samples_per_prompt": 0})


def answer_rows(prompt_id: str, prompt: list[int], answer: list[int]) -> list[dict]:
    """Trajectory rows of a given answer: each block's one noisy state, then its fixed point."""
    blocks = [
        SimpleNamespace(
            start=s, fixed_point=answer[s : s + N], states=[[99] * len(answer[s : s + N]), answer[s : s + N]]
        )
        for s in range(0, len(answer), N)
    ]
    return trajectory_rows(prompt_id, prompt, answer, blocks, N, "model-fp", "tok-fp")


def test_cut_loops_packs_each_answer_only_up_to_the_short_loop_it_ends_in(tmp_path):
    text = list(range(20, 39))  # 19 fresh tokens, then one token to the budget: a loop from token 19 on
    answers = {"looping": text + [13] * 21, "fresh": list(range(40, 80)), "all-loop": [13] * 40}
    rows = [r for i, (p, a) in enumerate(answers.items()) for r in answer_rows(p, [1 + i, 2], a)]
    path = write(tmp_path / "t.parquet", rows)
    plain, table = pack([path], tmp_path / "plain")
    assert {s["prompt_id"]: s["num_blocks"] for s in table.to_pylist()} == dict.fromkeys(answers, 5)
    assert plain.loop_blocks == 0
    cut, table = pack([path], tmp_path / "cut", cut_loops=True)
    seqs = {s["prompt_id"]: s for s in table.to_pylist()}
    assert {p: s["num_blocks"] for p, s in seqs.items()} == {"looping": 19 // N, "fresh": 5}  # whole blocks only
    clean = [t for _, l, _, _ in blocks_of(seqs["looping"]) for t in l]
    assert clean == text[: 2 * N]
    assert (cut.loop_blocks, cut.skipped, cut.dropped_blocks) == (3 + 5, 0, 0)


def test_a_longer_loop_period_also_cuts_an_answer_that_repeats_a_line(tmp_path):
    line = [100 + t for t in range(11)] + [198]  # a 12-token line, written again and again from token 16 on
    answers = {"repeated line": list(range(20, 36)) + line * 2 + [100, 101], "fresh": list(range(40, 82))}
    rows = [r for i, (p, a) in enumerate(answers.items()) for r in answer_rows(p, [1 + i, 2], a)]
    path = write(tmp_path / "t.parquet", rows)
    short, _ = pack([path], tmp_path / "short", cut_loops=True)
    assert short.loop_blocks == 0  # period 12: not a short loop
    long, table = pack([path], tmp_path / "long", cut_loops=True, loop_period=48)
    assert {s["prompt_id"]: s["num_blocks"] for s in table.to_pylist()} == {"repeated line": 16 // N, "fresh": 6}
    assert long.loop_blocks == 6 - 16 // N


def test_a_phrase_said_once_more_at_the_end_is_no_loop():
    from jfcore.evaluation.repetition import short_loop_start

    text, phrase = list(range(20, 40)), list(range(100, 110))
    assert short_loop_start(text + phrase + phrase[:9], period=48) is None  # under two whole periods
    assert short_loop_start(text + phrase * 2, period=48) == 20
    assert short_loop_start(text + phrase * 2) is None  # the default finds only periods of 1-2


def test_cut_loops_off_keeps_the_packed_folder_key_it_had_before_the_option():
    """A recipe that leaves cut_loops off must reuse what was packed (and trained on it) before cut_loops existed."""
    from tasks.packing import packing_identity

    config = PackingConfig(window=8, max_noise=0.5, samples_per_prompt=9)
    before = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("cut_loops", "loop_period")}
    assert packing_identity(config) == before
    assert packing_identity(dataclasses.replace(config, loop_period=48)) == before  # it cuts nothing unless on
    assert packing_identity(dataclasses.replace(config, cut_loops=True)) == before | {"cut_loops": True}
    longer = dataclasses.replace(config, cut_loops=True, loop_period=48)
    assert packing_identity(longer) == before | {"cut_loops": True, "loop_period": 48}
