"""The losses: what counts, what is ignored, and how it is reduced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jfcore.training import collate, consistency_loss, jacobi_forcing_loss
from jfcore.training.batch import IGNORE, collate_for, scored_columns
from jfcore.training.config import TrainConfig
from tests.support.training_data import packed_row

V, EOS, PADID = 11, 2, 0


def leaf_logits(batch, seed=0):
    torch.manual_seed(seed)
    return torch.randn(*batch.input_ids.shape, V, requires_grad=True)


def test_no_consistency_loss_when_noisy_equals_clean():
    blocks = [([3, 4, 5], [3, 4, 5]), ([6, 7, 8], [6, 7, 8])]
    batch = collate([packed_row([1, 9], blocks, mismatch=[3, 3], n=3)], PADID, EOS)
    logits = leaf_logits(batch)
    loss = consistency_loss(logits, batch, temperature=1.0)
    assert loss.item() == 0.0
    loss.backward()
    assert logits.grad is None or not logits.grad.any()


def test_only_offsets_from_the_first_mismatch_count_and_the_teacher_gets_no_gradient():
    # block 0 differs from offset 1 on, block 1 from offset 2 on; n = 4, prompt of 2
    blocks = [([3, 9, 9, 9], [3, 4, 5, 6]), ([7, 8, 9, 9], [7, 8, 5, 4])]
    batch = collate([packed_row([1, 10], blocks, mismatch=[1, 2], n=4)], PADID, EOS)
    logits = leaf_logits(batch)
    consistency_loss(logits, batch, temperature=1.0).backward()
    graded = logits.grad[0].abs().sum(-1).nonzero().flatten().tolist()
    # k_0 occupies 2..5 (offsets 1..3 -> 3,4,5); k_1 occupies 10..13 (offsets 2..3 -> 12,13)
    assert graded == [3, 4, 5, 12, 13]


def test_max_offset_keeps_only_the_pairs_nearest_the_first_mismatch_and_reweights_them():
    blocks = [([3, 9, 9, 9], [3, 4, 5, 6]), ([7, 8, 9, 9], [7, 8, 5, 4])]
    row = packed_row([1, 10], blocks, mismatch=[1, 2], n=4)
    batch = collate([row], PADID, EOS, max_offset=2)
    # block 0: offsets 0, 1 (positions 3, 4; not 5); block 1: offsets 0, 1 (positions 12, 13)
    assert batch.student_positions.tolist() == [3, 4, 12, 13]
    assert batch.pair_offsets.tolist() == [0, 1, 0, 1]
    assert torch.allclose(batch.pair_weights, torch.full((4,), 1 / (4 * 2)))  # mean over the 4 kept, T = 2
    assert collate([row], PADID, EOS, max_offset=1).pair_offsets.tolist() == [0, 0]


def test_reduction_is_mean_over_kept_pairs_then_over_blocks_then_over_rows():
    r1 = packed_row([1], [([3, 9], [3, 4]), ([5, 6], [5, 6])], mismatch=[1, 2], n=2)  # 1 kept pair, T = 2
    r2 = packed_row([1, 7, 8], [([9, 9], [4, 5])], mismatch=[0], n=2)  # 2 kept pairs, T = 1
    batch = collate([r1, r2], PADID, EOS)
    logits = leaf_logits(batch, seed=1)
    tau = 2.0

    def soft_ce(b, student, teacher):
        p = F.softmax(logits[b, teacher] / tau, -1)
        return -(p * F.log_softmax(logits[b, student] / tau, -1)).sum() * tau**2

    # r1: k_0 at 1..2, l_0 at 3..4 -> pair (2, 4). r2: k_0 at 3..4, l_0 at 5..6 -> pairs (3, 5), (4, 6).
    expected = (soft_ce(0, 2, 4) / 1 / 2 + (soft_ce(1, 3, 5) + soft_ce(1, 4, 6)) / 2 / 1) / 2
    torch.testing.assert_close(consistency_loss(logits, batch, tau), expected)


def test_ar_targets_stop_at_the_first_response_eos_and_skip_padding():
    # The prompt contains EOS (chat templates end turns with it): that one is ordinary.
    prompt = [1, EOS, 5]
    blocks = [([9, 9, 9], [6, EOS, 7]), ([9, 9], [8, 4])]  # tokens after the response EOS, and a short block
    batch = collate([packed_row(prompt, blocks, mismatch=[0, 0], n=3)], PADID, EOS)
    # clean stream: prompt 0..2, l_0 at 6..8, l_1 at 12..13 (14 is padding)
    assert batch.ar_positions.tolist() == [0, 1, 2, 6]
    assert batch.ar_targets.tolist() == [EOS, 5, 6, EOS]
    # consistency: l_0 offsets whose prediction is not past the EOS: offset 0 only (l_0[1] is the EOS)
    assert batch.student_positions.tolist() == [3] and batch.teacher_positions.tolist() == [6]


def test_ar_bridge_crosses_block_boundaries_and_padding_is_never_a_target():
    blocks = [([9, 9], [3, 4]), ([9, 9], [5, 9]), ([9, 9], [6, 0])]
    r = packed_row([1], blocks, mismatch=[0, 0, 0], n=2)
    r["valid_lengths"][-1] = 1  # the last block ends after one token; its second slot is padding
    batch = collate([r], PADID, EOS)
    # clean positions: prompt 0, l_0 3..4, l_1 7..8, l_2 11 (12 padding)
    assert batch.ar_positions.tolist() == [0, 3, 4, 7, 8]
    assert batch.ar_targets.tolist() == [3, 4, 5, 9, 6]
    assert batch.tokens == len(r["input_ids"]) - 2


def test_total_is_consistency_plus_lambda_times_ar():
    batch = collate([packed_row([1, 3], [([9, 9], [4, 5])], mismatch=[0], n=2)], PADID, EOS)
    logits = leaf_logits(batch, seed=2)
    losses = jacobi_forcing_loss(logits, batch, ar_weight=10.0, temperature=1.0)
    ar = F.cross_entropy(logits[0, [0, 1, 4]], torch.tensor([3, 4, 5]))
    torch.testing.assert_close(losses.ar, ar.detach())
    torch.testing.assert_close(losses.total, losses.consistency + 10.0 * ar)
    assert losses.consistency.item() > 0


def test_ar_without_the_prompt_keeps_the_step_into_the_response():
    prompt = [1, 7, 5]
    blocks = [([6, 9, 9], [6, 3, 4]), ([8, 9], [8, 4])]
    both = collate([packed_row(prompt, blocks, mismatch=[1, 1], n=3)], PADID, EOS)
    response_only = collate([packed_row(prompt, blocks, mismatch=[1, 1], n=3)], PADID, EOS, ar_prompt=False)
    # clean stream: prompt 0..2, l_0 at 6..8, l_1 at 12..13: the prompt's last token (2) predicts l_0's first
    assert both.ar_positions.tolist() == [0, 1, 2, 6, 7, 8, 12]
    assert response_only.ar_positions.tolist() == [2, 6, 7, 8, 12]
    assert response_only.ar_targets.tolist() == both.ar_targets.tolist()[2:] == [6, 3, 4, 8, 4]
    assert torch.equal(response_only.student_positions, both.student_positions)


def test_pair_offsets_count_from_each_blocks_first_mismatch():
    blocks = [([3, 9, 9, 9], [3, 4, 5, 6]), ([7, 8, 9, 9], [7, 8, 5, 4])]
    batch = collate([packed_row([1, 10], blocks, mismatch=[1, 2], n=4)], PADID, EOS)
    assert batch.student_positions.tolist() == [3, 4, 5, 12, 13]
    assert batch.pair_offsets.tolist() == [0, 1, 2, 0, 1]


def test_fixed_point_targets_are_the_next_clean_tokens_and_the_loss_scores_them():
    blocks = [([9, 9, 9], [4, 5, 6]), ([8, 8, 8], [7, 3, 5])]
    batch = collate([packed_row([1, 10], blocks, mismatch=[1, 0], n=3)], PADID, EOS, ar_prompt=False)
    # Block 0 from offset 1: 5 -> 6, 6 -> 7 (the bridge to block 1); block 1: 7 -> 3, 3 -> 5, 5 -> past the end.
    assert batch.pair_targets.tolist() == [6, 7, 3, 5, IGNORE]
    logits = leaf_logits(batch)
    flat = logits.reshape(-1, V)
    kept = batch.pair_targets != IGNORE
    expected = sum(
        w * F.cross_entropy(flat[s], y)
        for s, y, w in zip(batch.student_positions[kept], batch.pair_targets[kept], batch.pair_weights[kept])
    )
    loss = consistency_loss(logits, batch, temperature=2.0, target="fixed_point")
    assert torch.allclose(loss, expected) and not torch.allclose(loss, consistency_loss(logits, batch, 2.0))
    loss.backward()  # the student logits get the gradient; no teacher logit does (there is none)
    teacher_grad = logits.grad.reshape(-1, V)[batch.teacher_positions]
    assert torch.count_nonzero(teacher_grad) == 0 and torch.count_nonzero(logits.grad) > 0


def test_a_frozen_teacher_scores_the_clean_stream_by_kl_and_teaches_the_noisy_logits():
    # Two rows of different lengths: the clean stream is right-padded, and each packed clean position maps to its
    # place in it. Row 0: prompt 0..1, k_0 2..4, l_0 5..7. Row 1: prompt 0, k_0 1..3, l_0 4..6 (n = 3, one slot
    # of each padding).
    r0 = packed_row([1, 10], [([9, 9, 9], [4, 5, 6])], mismatch=[1], n=3)
    r1 = packed_row([1], [([9, 9], [7, 3])], mismatch=[0], n=3)
    batch = collate([r0, r1], PADID, EOS, ar_prompt=False)
    assert batch.clean_ids.tolist() == [[1, 10, 4, 5, 6], [1, 7, 3, PADID, PADID]]
    assert batch.clean_attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.clean_position_ids.tolist()[0] == [0, 1, 2, 3, 4]
    L, Lc = batch.input_ids.shape[1], batch.clean_ids.shape[1]
    assert batch.clean_index[[0, 1, 5, 6, 7]].tolist() == [0, 1, 2, 3, 4]
    assert batch.clean_index[[L + 0, L + 4, L + 5]].tolist() == [Lc + 0, Lc + 1, Lc + 2]
    assert batch.clean_index[[2, 3, 4, L + 1, L + 6]].tolist() == [-1] * 5  # noisy and padding slots

    logits = leaf_logits(batch, seed=3)
    torch.manual_seed(4)
    frozen = torch.randn(2, Lc, V, requires_grad=True)  # to show no gradient reaches it
    losses = jacobi_forcing_loss(logits, batch, ar_weight=2.0, temperature=1.0, frozen=frozen)
    flat, teacher = logits.reshape(-1, V), frozen.detach().reshape(-1, V)

    def kl(student, target):  # KL(softmax(target) || softmax(student))
        p = F.log_softmax(teacher[target], -1)
        return (p.exp() * (p - F.log_softmax(flat[student], -1))).sum()

    ar_pairs = [(1, 1), (5, 2), (6, 3), (L + 0, Lc + 0), (L + 4, Lc + 1)]  # (packed logit, clean-stream logit)
    assert batch.ar_positions.tolist() == [s for s, _ in ar_pairs]
    per_row = [sum(kl(s, c) for s, c in ar_pairs[:3]) / 3, sum(kl(s, c) for s, c in ar_pairs[3:]) / 2]
    torch.testing.assert_close(losses.ar, (sum(per_row) / 2).detach())  # mean per row, then over the rows
    # Consistency: the students learn the frozen teacher's clean logits, not this forward's.
    pairs = [(3, 3), (4, 4), (L + 1, Lc + 1), (L + 2, Lc + 2)]  # row 0 from offset 1; row 1 from 0
    assert batch.student_positions.tolist() == [s for s, _ in pairs]

    def soft_ce(student, target):
        return -(F.softmax(teacher[target], -1) * F.log_softmax(flat[student], -1)).sum()

    expected = sum(w * soft_ce(s, c) for (s, c), w in zip(pairs, batch.pair_weights))
    torch.testing.assert_close(losses.consistency, expected.detach())
    assert not torch.allclose(losses.consistency, consistency_loss(logits, batch, 1.0))
    losses.total.backward()
    assert frozen.grad is None and torch.count_nonzero(logits.grad) > 0


def test_a_margin_asks_only_that_each_fixed_point_token_stay_the_argmax_by_that_much():
    # AR pairs of this row: the prompt's last logit (position 1) -> 4, then l_0's logits (4, 5) -> 5 and 6.
    batch = collate([packed_row([1, 3], [([9, 9, 9], [4, 5, 6])], mismatch=[1], n=3)], PADID, EOS, ar_prompt=False)
    assert batch.ar_positions.tolist() == [1, 5, 6] and batch.ar_targets.tolist() == [4, 5, 6]
    logits = torch.zeros(*batch.input_ids.shape, V)
    logits[0, 1, 4], logits[0, 1, 8] = 3.0, 1.0  # argmax by 2.0: clear of a margin of 1
    logits[0, 5, 5], logits[0, 5, 7] = 1.2, 1.0  # argmax by 0.2: 0.8 short
    logits[0, 6, 6], logits[0, 6, 2] = 0.5, 2.0  # another token leads by 1.5: 2.5 short
    logits.requires_grad_(True)
    losses = jacobi_forcing_loss(logits, batch, ar_weight=3.0, temperature=1.0, margin=1.0)
    torch.testing.assert_close(losses.ar, torch.tensor((0.0 + 0.8 + 2.5) / 3))
    torch.testing.assert_close(losses.total, losses.consistency + 3.0 * losses.ar)
    losses.total.backward()
    # The held position gets no gradient from L_AR; a short one raises its token and lowers the one in its way.
    ar_grad = logits.grad[0, [1, 5, 6]]
    assert torch.count_nonzero(ar_grad[0]) == 0
    assert ar_grad[1, 5] == ar_grad[2, 6] == -1.0 and ar_grad[1, 7] == ar_grad[2, 2] == 1.0
    assert torch.count_nonzero(ar_grad[1:]) == 4


def test_pairs_whose_token_prompt_lookup_would_copy_are_flagged_and_can_be_left_out():
    # Clean text 1 4 5 | 6 4 5 | 6 3 8. Lookup (the decoder's, 1-3 token suffixes) would copy 5 after "6 4" (4 was
    # followed by 5) and 6 after "4 5" (4 5 was followed by 6), but offers 4, not 3, after "4 5 6", and nothing
    # for the first 6, the first 4 or the 8.
    blocks = [([9, 9, 9], [6, 4, 5]), ([9, 9, 9], [6, 3, 8])]
    row = packed_row([1, 4, 5], blocks, mismatch=[0, 0], n=3)
    kept = collate([row], PADID, EOS, ar_prompt=False)
    assert kept.pair_targets.tolist() == [4, 5, 6, 3, 8, IGNORE]
    assert kept.pair_copyable.tolist() == [False, True, True, False, False, False]
    skipped = collate([row], PADID, EOS, ar_prompt=False, copy_pairs=False)
    # k_0 sits at 3..5 and k_1 at 9..11: offsets 1 and 2 of block 0 go; the rest are reweighted over 4 pairs, T = 2
    assert skipped.student_positions.tolist() == [3, 9, 10, 11]
    assert skipped.pair_copyable.tolist() == [False] * 4
    assert torch.allclose(skipped.pair_weights, torch.full((4,), 1 / (4 * 2)))
    assert skipped.ar_positions.tolist() == kept.ar_positions.tolist()  # L_AR still scores the whole text
    # A training step builds its batch from the config the same way.
    for copies, expected in (("keep", kept), ("skip", skipped)):
        config = TrainConfig(data="d", output_dir="o", consistency_copies=copies)
        assert collate_for(config, [row], PADID, EOS).student_positions.tolist() == expected.student_positions.tolist()


def test_the_copy_penalty_scores_only_positions_where_lookup_would_copy_a_wrong_token():
    # The same text 1 4 5 | 6 4 5 | 6 3 8: lookup's candidates for the response are none, none, 5, 6, 4, none, and
    # only the 4 offered in place of the 3 is wrong (5 and 6 are the text's own next tokens).
    blocks = [([9, 9, 9], [6, 4, 5]), ([9, 9, 9], [6, 3, 8])]
    row = packed_row([1, 4, 5], blocks, mismatch=[0, 0], n=3)
    batch = collate([row], PADID, EOS, ar_prompt=False)
    assert batch.ar_targets.tolist() == [6, 4, 5, 6, 3, 8]
    assert batch.ar_wrong_copies.tolist() == [IGNORE] * 4 + [4, IGNORE]
    # The prompt's own pairs never carry one: nothing before them to copy from within the response.
    with_prompt = collate([row], PADID, EOS, ar_prompt=True)
    assert with_prompt.ar_wrong_copies.tolist() == [IGNORE] * 6 + [4, IGNORE]

    logits = leaf_logits(batch, seed=3)
    at = batch.ar_positions[4].item()
    p_copy = F.softmax(logits.detach().reshape(-1, V)[at], dim=-1)[4]
    plain = jacobi_forcing_loss(logits, batch, ar_weight=0.5, temperature=1.0)
    penalized = jacobi_forcing_loss(logits, batch, ar_weight=0.5, temperature=1.0, copy_weight=2.0)
    assert penalized.copy.item() == pytest.approx(-torch.log1p(-p_copy).item(), rel=1e-5)
    assert plain.copy.item() == penalized.copy.item()  # measured either way, added only when weighted
    assert penalized.total.item() == pytest.approx(plain.total.item() + 2.0 * penalized.copy.item(), rel=1e-6)
    # Its gradient reaches that clean position alone, and lowers the copy's logit.
    (penalized.total - plain.total).backward()
    graded = logits.grad.reshape(-1, V).abs().sum(-1).nonzero().flatten().tolist()
    assert graded == [at]
    assert logits.grad.reshape(-1, V)[at, 4] > 0


def test_a_batch_with_no_wrong_copy_adds_no_copy_penalty_and_keeps_the_graph():
    batch = collate([packed_row([1, 9], [([3, 4, 5], [3, 4, 5])], mismatch=[3], n=3)], PADID, EOS)
    assert (batch.ar_wrong_copies == IGNORE).all()
    logits = leaf_logits(batch)
    losses = jacobi_forcing_loss(logits, batch, ar_weight=1.0, temperature=1.0, copy_weight=1.0)
    assert losses.copy.item() == 0.0
    losses.total.backward()  # the AR term still trains
    assert logits.grad.abs().sum() > 0


def test_the_copy_penalty_weight_is_checked_at_load():
    with pytest.raises(ValueError, match="copy_unlikelihood: must be >= 0"):
        TrainConfig(data="d", output_dir="o", copy_unlikelihood=-1.0)


def test_the_repeat_penalty_scores_the_last_few_tokens_other_than_the_target_at_every_clean_position():
    # Clean stream 1 4 5 | 6 4 5 | 6 3 8 (prompt 1 4 5). Each scored position's candidates are the last 4 tokens up to
    # it, newest first, each once, without the token the text goes on with.
    blocks = [([9, 9, 9], [6, 4, 5]), ([9, 9, 9], [6, 3, 8])]
    batch = collate([packed_row([1, 4, 5], blocks, mismatch=[0, 0], n=3)], PADID, EOS, ar_prompt=False)
    assert batch.ar_targets.tolist() == [6, 4, 5, 6, 3, 8]
    assert batch.ar_recent.tolist() == [
        [5, 4, 1, IGNORE],
        [6, 5, 1, IGNORE],  # 4 is the target
        [4, 6, IGNORE, IGNORE],  # 5 is the target, 4 counted once
        [5, 4, IGNORE, IGNORE],
        [6, 5, 4, IGNORE],
        [3, 6, 5, 4],
    ]

    logits = leaf_logits(batch, seed=4)
    probs = F.softmax(logits.detach().reshape(-1, V)[batch.ar_positions], dim=-1)
    expected = [
        -torch.log1p(-sum(probs[i, c] for c in row if c != IGNORE)) for i, row in enumerate(batch.ar_recent.tolist())
    ]
    plain = jacobi_forcing_loss(logits, batch, ar_weight=0.5, temperature=1.0)
    penalized = jacobi_forcing_loss(logits, batch, ar_weight=0.5, temperature=1.0, repeat_weight=3.0)
    assert penalized.repeat.item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)
    assert plain.repeat.item() == penalized.repeat.item()  # measured either way, added only when weighted
    assert penalized.total.item() == pytest.approx(plain.total.item() + 3.0 * penalized.repeat.item(), rel=1e-6)
    # Its gradient lowers every candidate's logit at its position and raises the target's.
    (penalized.total - plain.total).backward()
    grad = logits.grad.reshape(-1, V)[batch.ar_positions]
    for i, (row, target) in enumerate(zip(batch.ar_recent.tolist(), batch.ar_targets.tolist())):
        assert all(grad[i, c] > 0 for c in row if c != IGNORE)
        assert grad[i, target] < 0


def test_the_repeat_penalty_leaves_alone_the_loops_the_text_itself_makes():
    # The text 7 7 7 after the prompt 1: the loop is the text, so 7 is never a candidate; only the 1 before it is.
    batch = collate([packed_row([1], [([9, 9, 9], [7, 7, 7])], mismatch=[0], n=3)], PADID, EOS, ar_prompt=False)
    assert batch.ar_targets.tolist() == [7, 7, 7]
    assert batch.ar_recent.tolist() == [[1, IGNORE, IGNORE, IGNORE]] * 3
    # A target with nothing before it but itself has no candidate, and the penalty keeps the graph.
    alone = collate([packed_row([7], [([9], [7])], mismatch=[0], n=1)], PADID, EOS, ar_prompt=False)
    assert alone.ar_recent.tolist() == [[IGNORE] * 4]
    logits = leaf_logits(alone)
    losses = jacobi_forcing_loss(logits, alone, ar_weight=1.0, temperature=1.0, repeat_weight=1.0)
    assert losses.repeat.item() == 0.0
    losses.total.backward()
    assert logits.grad.abs().sum() > 0


def test_the_repeat_penalty_weight_is_checked_at_load():
    with pytest.raises(ValueError, match="repeat_unlikelihood: must be >= 0"):
        TrainConfig(data="d", output_dir="o", repeat_unlikelihood=-0.5)


def scoring_rows_list():
    # Row 0: block 0 wrong from offset 1, block 1 from offset 2; row 1 shorter, wrong from offset 0. With two offsets
    # kept, each block's noisy slots past them are scored by no loss, nor is row padding.
    r0 = packed_row([1, 10], [([3, 9, 9, 9], [3, 4, 5, 6]), ([7, 8, 9, 9], [7, 8, 5, 4])], mismatch=[1, 2], n=4)
    r1 = packed_row([1], [([9, 9, 9, 9], [6, 5, 6, 5])], mismatch=[0], n=4)
    return [r0, r1]


def scoring_rows():
    return collate(scoring_rows_list(), PADID, EOS, max_offset=2)


@pytest.mark.parametrize("teacher", ["own", "frozen"])
def test_logits_at_the_scored_columns_only_give_the_same_losses_and_gradients(teacher):
    batch = scoring_rows()
    kept, scored = scored_columns(batch)
    L = batch.input_ids.shape[1]
    # Row 0: prompt 0..1, k_0 2..5, l_0 6..9, k_1 10..13, l_1 14..17; its k_1 is right up to offset 2, and row 1 is
    # padding there: no loss reads columns 10 and 11.
    assert kept.tolist() == [c for c in range(L) if c not in (10, 11)]
    logits = leaf_logits(batch, seed=5)
    frozen = torch.randn(*batch.clean_ids.shape, V) if teacher == "frozen" else None
    settings = {"ar_weight": 0.3, "temperature": 2.0, "frozen": frozen, "copy_weight": 0.5, "repeat_weight": 2.0}
    full = jacobi_forcing_loss(logits, batch, **settings)
    full.total.backward()
    narrow_logits = logits.detach()[:, kept].clone().requires_grad_(True)
    narrow = jacobi_forcing_loss(narrow_logits, scored, **settings)
    narrow.total.backward()
    for name in ("total", "ar", "consistency", "copy", "repeat"):
        torch.testing.assert_close(getattr(narrow, name), getattr(full, name), msg=name)
    torch.testing.assert_close(narrow_logits.grad, logits.grad[:, kept])
    assert not logits.grad[:, [c for c in range(L) if c not in kept.tolist()]].any()  # nothing was left out


def test_a_models_logits_to_keep_at_the_scored_columns_gives_the_full_forwards_gradients():
    from jfcore.training.mask import attention_mask
    from tests.support.tiny_models import tiny_model

    batch = scoring_rows()
    kept, scored = scored_columns(batch)
    mask = attention_mask(batch.streams, "sdpa", torch.float32, batch.blocks)
    grads = []
    for columns, target in ((None, batch), (kept, scored)):
        model = tiny_model("llama").train()
        extra = {} if columns is None else {"logits_to_keep": columns}
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask, **extra)
        assert out.logits.shape[1] == (batch.input_ids.shape[1] if columns is None else len(kept))
        jacobi_forcing_loss(out.logits, target, 0.3, 1.0, repeat_weight=2.0).total.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for full, narrow in zip(*grads):
        torch.testing.assert_close(narrow, full, rtol=1e-4, atol=1e-6)


def test_a_forward_that_takes_logits_to_keep_but_ignores_the_positions_is_refused():
    from jfcore.training.loop import forward_scored
    from jfcore.training.mask import attention_mask
    from tests.support.tiny_models import tiny_model

    class IgnoresPositions(torch.nn.Module):  # takes the argument, returns every position's logits
        def __init__(self):
            super().__init__()
            self.inner = tiny_model("llama")

        def forward(self, input_ids, position_ids, attention_mask, use_cache, logits_to_keep=0):
            return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask)

    batch = scoring_rows()
    kept, _ = scored_columns(batch)
    mask = attention_mask(batch.streams, "sdpa", torch.float32, batch.blocks)
    logits, scored = forward_scored(tiny_model("llama"), batch, mask, keeps_logits=True)
    assert logits.shape[1] == len(kept) and torch.equal(scored.ar_positions, scored_columns(batch)[1].ar_positions)
    assert forward_scored(tiny_model("llama"), batch, mask, keeps_logits=False)[0].shape[1] == batch.input_ids.shape[1]
    with pytest.raises(RuntimeError, match="returned logits at 18 positions for the 16 asked for"):
        forward_scored(IgnoresPositions(), batch, mask, keeps_logits=True)


@pytest.mark.parametrize("variant", ["own", "frozen", "margin"])
def test_a_batch_of_rows_scores_and_trains_as_the_mean_of_its_rows_scored_alone(variant):
    # What gradient accumulation over one-row micro batches computes: a wider micro batch must give the same loss
    # and gradient, or changing micro_batch_size would change what a recipe trains. The rows differ in length (so
    # right padding), in their number of AR targets and of kept pairs, and row 2 has a wrong copy to penalise.
    from jfcore.training.mask import attention_mask
    from tests.support.tiny_models import VOCAB, tiny_model

    r0, r1 = scoring_rows_list()
    r2 = packed_row([5, 6, 7, 5], [([6, 9, 9], [6, 8, 3])], mismatch=[1], n=3)
    rows = [r0, r1, r2]
    torch.manual_seed(7)
    frozen_all = torch.randn(len(rows), 32, VOCAB) if variant == "frozen" else None
    settings = {"ar_weight": 0.3, "temperature": 2.0, "copy_weight": 0.5, "repeat_weight": 2.0}
    settings["margin"] = 1.0 if variant == "margin" else None

    def run(chunk: list[int]):
        batch = collate([rows[i] for i in chunk], PADID, EOS)
        model = tiny_model("llama").train()
        mask = attention_mask(batch.streams, "sdpa", torch.float32, batch.blocks)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask).logits
        frozen = None if frozen_all is None else frozen_all[chunk, : batch.clean_ids.shape[1]]
        losses = jacobi_forcing_loss(logits, batch, frozen=frozen, **settings)
        losses.total.backward()
        return losses, [p.grad for p in model.parameters()]

    together, together_grads = run([0, 1, 2])
    alone = [run([i]) for i in range(3)]
    assert together.copy > 0 and len({float(a.ar) for a, _ in alone}) == 3
    for name in ("total", "ar", "consistency", "copy", "repeat"):
        mean = sum(getattr(a, name) for a, _ in alone) / 3
        torch.testing.assert_close(getattr(together, name), mean, rtol=1e-5, atol=1e-6, msg=name)
    for i, grad in enumerate(together_grads):
        torch.testing.assert_close(grad, sum(g[i] for _, g in alone) / 3, rtol=1e-4, atol=1e-6)
