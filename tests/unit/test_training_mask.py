"""One packed forward under the noise-aware mask equals separate plain causal forwards."""

from __future__ import annotations

import random

import pytest
import torch

from jfcore.training import (
    CLEAN,
    NOISY,
    PAD,
    PROMPT,
    allowed,
    attention_mask,
    block_mask,
    collate,
    dense_mask,
    jacobi_forcing_loss,
)
from tests.support.tiny_models import VOCAB, tiny_model

N = 4


def packed_row(seed: int, P: int, valid: list[int]) -> tuple[dict, list[list[int]], list[list[int]]]:
    """A packed row with random prompt, noisy and clean blocks; returns it with its k_j and l_j (valid parts)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(P)]
    ids, noisy, clean = list(prompt), [], []
    for m in valid:
        k = [rng.randrange(VOCAB) for _ in range(m)]
        l = [rng.randrange(VOCAB) for _ in range(m)]
        noisy.append(k)
        clean.append(l)
        ids += k + [0] * (N - m) + l + [0] * (N - m)
    positions = list(range(P)) + [p for j in range(len(valid)) for p in list(range(P + j * N, P + (j + 1) * N)) * 2]
    row = {
        "prompt_id": str(seed),
        "input_ids": ids,
        "position_ids": positions,
        "prompt_length": P,
        "block_size": N,
        "num_blocks": len(valid),
        "first_mismatch": [0] * len(valid),
        "valid_lengths": valid,
    }
    return row, noisy, clean


def plain_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def packed_logits(model, rows: list[dict], attn: str = "sdpa", context: str = "noisy") -> tuple[torch.Tensor, int]:
    batch = collate(rows, pad_token_id=0, eos_token_id=None)
    mask = attention_mask(batch.streams, attn, torch.float32, batch.blocks, context)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask, use_cache=False)
    return out.logits, batch.input_ids.shape[1]


def assert_streams_match(model, rows, noisy_clean, logits, context: str = "noisy") -> None:
    for b, (row, (noisy, clean)) in enumerate(zip(rows, noisy_clean)):
        P, prompt = row["prompt_length"], row["input_ids"][: row["prompt_length"]]
        clean_plain = plain_logits(model, prompt + [t for l in clean for t in l])
        torch.testing.assert_close(logits[b, :P], clean_plain[:P], atol=1e-5, rtol=1e-5)
        done = P
        for j, (k, l) in enumerate(zip(noisy, clean)):
            start = P + 2 * j * N
            torch.testing.assert_close(
                logits[b, start + N : start + N + len(l)], clean_plain[done : done + len(l)], atol=1e-5, rtol=1e-5
            )
            before = noisy[:j] if context == "noisy" else clean[:j]  # what k_j sees of the blocks before it
            noisy_plain = plain_logits(model, prompt + [t for kk in before for t in kk] + k)
            torch.testing.assert_close(logits[b, start : start + len(k)], noisy_plain[-len(k) :], atol=1e-5, rtol=1e-5)
            done += len(l)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_packed_forward_equals_plain_forwards(arch):
    model = tiny_model(arch, seed=3)
    row, noisy, clean = packed_row(seed=1, P=6, valid=[N, N, N])
    logits, _ = packed_logits(model, [row])
    assert_streams_match(model, [row], [(noisy, clean)], logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_padded_batch_keeps_every_row_exact(arch):
    """Rows of different lengths, one with a short last block, one with a single block, batched together."""
    model = tiny_model(arch, seed=4)
    specs = [(5, [N, N, 2]), (9, [N]), (3, [N, 1])]
    made = [packed_row(seed=10 + i, P=P, valid=v) for i, (P, v) in enumerate(specs)]
    rows = [r for r, _, _ in made]
    logits, _ = packed_logits(model, rows)
    assert_streams_match(model, rows, [(k, l) for _, k, l in made], logits)


def test_clean_context_noisy_blocks_see_the_fixed_points_before_them():
    """noisy_context: clean: k_j's logits are a plain forward over the prompt, l_<j and k_j; the clean stream is
    unchanged."""
    model = tiny_model("llama", seed=3)
    specs = [(5, [N, N, 2]), (3, [N])]
    made = [packed_row(seed=20 + i, P=P, valid=v) for i, (P, v) in enumerate(specs)]
    rows = [r for r, _, _ in made]
    logits, _ = packed_logits(model, rows, context="clean")
    assert_streams_match(model, rows, [(k, l) for _, k, l in made], logits, context="clean")
    noisy, _ = packed_logits(model, rows)
    assert not torch.allclose(noisy[0], logits[0])  # the two contexts really differ (the first row has 3 blocks)
    with pytest.raises(ValueError, match="needs each token's block"):
        attention_mask(collate(rows, 0, None).streams, "sdpa", torch.float32, context="clean")


def test_eager_attention_takes_the_same_mask():
    model = tiny_model("llama", seed=5, attn="eager")
    row, noisy, clean = packed_row(seed=2, P=4, valid=[N, 3])
    logits, _ = packed_logits(model, [row])
    assert_streams_match(model, [row], [(noisy, clean)], logits)


def test_mask_rule_by_hand():
    """Prompt of 2, two blocks of 2, the second block 1 valid: the visibility table written out."""
    streams = torch.tensor([[PROMPT, PROMPT, NOISY, NOISY, CLEAN, CLEAN, NOISY, PAD, CLEAN, PAD, PAD]])
    expected = {  # query -> visible keys
        0: {0},
        1: {0, 1},
        2: {0, 1, 2},
        3: {0, 1, 2, 3},  # k_0
        4: {0, 1, 4},
        5: {0, 1, 4, 5},  # l_0
        6: {0, 1, 2, 3, 6},  # k_1 sees k_0, never l_0
        7: {7},  # padding sees only itself
        8: {0, 1, 4, 5, 8},  # l_1 sees l_0, never k_*
        9: {9},
        10: {10},
    }
    table = allowed(streams)[0]
    assert {q: set(table[q].nonzero().flatten().tolist()) for q in range(11)} == expected
    additive = dense_mask(streams, torch.float32)[0, 0]
    assert torch.equal(additive == 0, table)


@pytest.mark.parametrize("context", ["noisy", "clean"])
def test_block_mask_has_the_dense_rule(context):
    rows = [packed_row(seed=7, P=5, valid=[N, N, 3])[0], packed_row(seed=8, P=2, valid=[N])[0]]
    batch = collate(rows, 0, None)
    bm = block_mask(batch.streams, batch.blocks, context)
    L = batch.streams.shape[1]
    q, k = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
    for b in range(2):
        evaluated = bm.mask_mod(torch.tensor(b), torch.tensor(0), q, k)
        assert torch.equal(evaluated, allowed(batch.streams, batch.blocks, context)[b])


def test_flex_attention_forward_equals_plain_forwards():
    """The BlockMask path end to end (flex attention also runs on CPU, compiled)."""
    model = tiny_model("llama", seed=6, attn="flex_attention")
    row, noisy, clean = packed_row(seed=3, P=6, valid=[N, N, 2])
    logits, _ = packed_logits(model, [row], attn="flex_attention")
    reference = tiny_model("llama", seed=6)
    assert_streams_match(reference, [row], [(noisy, clean)], logits)


def test_flash_attention_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="flex_attention"):
        attention_mask(torch.zeros(1, 4, dtype=torch.int8), "flash_attention_2", torch.float32)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_frozen_copy_reading_the_clean_stream_predicts_what_the_packed_clean_stream_does(arch):
    """What a frozen teacher sees (the clean stream alone, causal) is what the packed forward's clean stream sees, so
    with the starting model as its own frozen teacher the KL term is 0 and the consistency targets are unchanged."""
    model = tiny_model(arch, seed=5)
    specs = [(5, [N, N, 2]), (9, [N]), (3, [N, 1])]
    rows = [packed_row(seed=20 + i, P=P, valid=v)[0] for i, (P, v) in enumerate(specs)]
    batch = collate(rows, pad_token_id=0, eos_token_id=None)
    packed, _ = packed_logits(model, rows)
    with torch.no_grad():
        frozen = model(
            input_ids=batch.clean_ids, position_ids=batch.clean_position_ids, attention_mask=batch.clean_attention
        ).logits
    on_clean = batch.clean_index >= 0
    assert on_clean.sum() == ((batch.streams == PROMPT) | (batch.streams == CLEAN)).sum()
    flat_packed, flat_frozen = packed.reshape(-1, packed.shape[-1]), frozen.reshape(-1, frozen.shape[-1])
    torch.testing.assert_close(flat_frozen[batch.clean_index[on_clean]], flat_packed[on_clean], atol=1e-5, rtol=1e-5)
    own = jacobi_forcing_loss(packed, batch, ar_weight=1.0, temperature=1.0)
    taught = jacobi_forcing_loss(packed, batch, ar_weight=1.0, temperature=1.0, frozen=frozen)
    assert taught.ar.abs() < 1e-5 < own.ar
    torch.testing.assert_close(taught.consistency, own.consistency, atol=1e-5, rtol=1e-5)
