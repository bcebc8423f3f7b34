"""Acceptance measured while training: the simulated TPF against the decoder's own, and noisy accuracy against
a direct count."""

from __future__ import annotations

import pytest
import torch

from jfcore.decoding import DecodeConfig, decode
from jfcore.training import attention_mask, collate
from jfcore.training.acceptance import Example, examples, measure, simulated_tpf
from tests.support.tiny_models import position_model, tiny_model
from tests.support.training_data import packed_row

PROMPTS = [[7, 3, 9, 1, 4, 4, 2], [5, 6], [11, 12, 13, 40, 41]]


def training_forward(model, row):
    """The row's logits under the training mask, computed here rather than through acceptance."""
    batch = collate([row], 0, None)
    with torch.no_grad():
        return model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=attention_mask(batch.streams, "sdpa", torch.float32),
        ).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_simulated_tpf_is_the_decoders_tpf_on_the_models_own_text(arch, block_size):
    """Teacher forcing on the model's own greedy text is what the decoder does: the same forwards, block by block."""
    model = tiny_model(arch)
    own = decode(model, PROMPTS, DecodeConfig(method="ar", max_new_tokens=21), eos_token_id=[], pad_token_id=0)
    for prompt, response in zip(PROMPTS, own.sequences):
        jacobi = DecodeConfig(method="jacobi", block_size=block_size, max_new_tokens=len(response))
        decoded = decode(model, [prompt], jacobi, eos_token_id=[], pad_token_id=0)
        assert decoded.sequences[0] == response
        simulated = simulated_tpf(model, [Example(prompt, response)], [block_size, 3], pad_token_id=0)
        assert simulated[block_size] == (len(response), decoded.stats.decode_forwards)


def test_simulated_tpf_sees_drafts_that_are_right_whatever_the_context():
    """A model that predicts from positions alone makes every draft exact after one update: two forwards a block."""
    model = position_model()
    response = decode(model, PROMPTS[:1], DecodeConfig(method="ar", max_new_tokens=24), eos_token_id=[], pad_token_id=0)
    simulated = simulated_tpf(model, [Example(PROMPTS[0], response.sequences[0])], [8, 4], pad_token_id=0)
    assert simulated == {8: (24, 3 * 2), 4: (24, 6 * 2)}


def test_noisy_accuracy_counts_the_students_argmax_against_the_fixed_point():
    model = tiny_model("llama")
    prompt, n = [3, 1, 4], 4
    blocks = [([20, 21, 22, 23], [20, 30, 31, 32]), ([33, 5, 6, 7], [33, 34, 35, 36]), ([37, 38], [37, 38])]
    row = packed_row(prompt, blocks, mismatch=[1, 1, 2], n=n)
    assert examples([row]) == [Example(prompt, [20, 30, 31, 32, 33, 34, 35, 36, 37, 38])]
    result = measure(model, [row], [], tokens=64, pad_token_id=0, eos_token_id=None, attn="sdpa")
    # The same forward by hand: the noisy stream's argmax at k_j + t against l_j's token after t.
    logits = training_forward(model, row)
    P, hits = len(prompt), {}
    for j, (d, (_, clean)) in enumerate(zip([1, 1], blocks[:2])):
        following = clean[1:] + [blocks[j + 1][1][0]]  # the fixed point's next token, across the block boundary
        for t in range(d, n):
            hits.setdefault(t - d, []).append(int(logits[P + 2 * j * n + t].argmax()) == following[t])
    total = sum(len(h) for h in hits.values())
    assert result.noisy_pairs[-1] == total == 6  # block 2 has no pair: its noisy copy is its fixed point
    assert result.noisy_correct[-1] == sum(sum(h) for h in hits.values())
    assert result.noisy_pairs[:3] == [2, 2, 2] and result.noisy_correct[:3] == [sum(hits[k]) for k in range(3)]
    run = sum(
        next((i for i, h in enumerate(hs) if not h), len(hs))
        for hs in ([hits[k][b] for k in range(3)] for b in range(2))
    )
    assert result.run_blocks == 2 and result.run_tokens == run
    # Text kept: the clean stream's argmax against its next token, from the prompt's last token to l_2's first.
    clean = [P - 1] + [P + (2 * j + 1) * n + t for j, (_, c) in enumerate(blocks) for t in range(len(c))][:-1]
    following = examples([row])[0].response
    assert result.text_tokens == len(clean) == 10
    assert result.text_kept == sum(int(logits[p].argmax()) == y for p, y in zip(clean, following))
    assert model.training is False  # measure puts the model back as it was (eval here)


def test_a_flex_attention_model_is_simulated_through_sdpa_and_left_as_it_was():
    """GPU training loads models with flex attention, which cannot take the simulation's additive masks."""
    sdpa, flex = tiny_model("llama", attn="sdpa"), tiny_model("llama", attn="flex_attention")
    example = [Example(PROMPTS[0], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])]
    with torch.no_grad():
        assert simulated_tpf(flex, example, [4], 0) == simulated_tpf(sdpa, example, [4], 0)
    assert flex.config._attn_implementation == "flex_attention"


def _rank(rank: int, world: int, init: str, rows: list[dict], out) -> None:
    import torch.distributed as dist

    from jfcore.training.acceptance import Ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = measure(tiny_model("qwen2"), rows, [2, 4], 9, 0, None, "sdpa", Ranks(rank, world))
        out.put((rank, result.metrics()))
    finally:
        dist.destroy_process_group()


def test_two_ranks_measure_what_one_measures(tmp_path):
    """Ranks split the prompts and take every forward together (the idle one runs one-token forwards), so the
    figures are the same as one process measuring everything; a rank that stopped early would hang the other."""
    import torch.multiprocessing as mp

    model = tiny_model("qwen2")
    own = decode(model, PROMPTS, DecodeConfig(method="ar", max_new_tokens=9), eos_token_id=[], pad_token_id=0)
    rows = [  # three prompts (two ranks: 2 and 1), each with its greedy answer as fixed points and noisy copies
        packed_row(p, [([(t + 1) % 90 for t in seq[:4]], seq[:4]), (seq[4:8], seq[4:8]), ([7], [seq[8]])], [0, 4, 0], 4)
        for p, seq in zip(PROMPTS, own.sequences)
    ]
    alone = measure(model, rows, [2, 4], 9, 0, None, "sdpa").metrics()
    context = mp.get_context("spawn")
    out = context.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    workers = [context.Process(target=_rank, args=(r, 2, init, rows, out)) for r in range(2)]
    for w in workers:
        w.start()
    results = dict(out.get(timeout=300) for _ in workers)
    for w in workers:
        w.join(timeout=60)
    assert results[0] == results[1] == pytest.approx(alone)
    assert alone["heldout/simulated_tpf_n2"] > 1 and "heldout/noisy_accuracy_at_1" in alone
    assert alone["heldout/text_kept"] == 1.0  # the fixed points are the model's own greedy text


def test_noisy_accuracy_is_split_between_tokens_prompt_lookup_would_copy_and_the_rest():
    model = tiny_model("llama")
    prompt, n = [1, 4, 5], 3
    # As in test_training_losses: of block 0's targets 4, 5, 6 lookup would copy 5 and 6; block 1's 3 and 8 it would
    # not (its last position predicts past the response and is no pair here).
    blocks = [([9, 9, 9], [6, 4, 5]), ([9, 9, 9], [6, 3, 8])]
    row = packed_row(prompt, blocks, mismatch=[0, 0], n=n)
    result = measure(model, [row], [], tokens=64, pad_token_id=0, eos_token_id=None, attn="sdpa")
    logits = training_forward(model, row)
    hit = {
        (j, t): int(logits[3 + 2 * j * n + t].argmax()) == y
        for (j, t), y in zip([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)], [4, 5, 6, 3, 8])
    }
    assert (result.noisy_pairs[-1], result.copyable_pairs) == (5, 2)
    assert result.copyable_correct == hit[0, 1] + hit[0, 2]
    assert result.noisy_correct[-1] == sum(hit.values())
    figures = result.metrics()
    assert figures["heldout/copyable_share"] == 2 / 5
    assert figures["heldout/noisy_accuracy_copyable"] == (hit[0, 1] + hit[0, 2]) / 2
    assert figures["heldout/noisy_accuracy_uncopyable"] == (hit[0, 0] + hit[1, 0] + hit[1, 1]) / 3
