"""Anchored trajectories: the model's own Jacobi iterates on each block of a reference text, ending at the
reference's blocks. Checked against the decoder itself on the model's own text, and against plain causal forwards
on a text the model would not write."""

from __future__ import annotations

import itertools

import pytest
import torch

from jfcore.decoding import decode
from jfcore.teacher_forced import anchored_blocks, next_draft, verified
from jfcore.trajectories import TrajectoryConfig, anchored_trajectories, first_mismatch, rows_to_table, trajectory_rows
from tests.support.tiny_models import tiny_model

PROMPTS = [[7, 3, 9, 1, 4, 4, 2], [5, 6], [11, 12, 13, 40, 41]]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("block_size", [3, 4])
def test_on_the_models_own_text_they_are_the_decoders_trajectories(arch, block_size):
    """Anchored to its own greedy text, a model's iterates are exactly the states the Jacobi decoder records."""
    model = tiny_model(arch)
    config = TrajectoryConfig(block_size=block_size, max_new_tokens=13)
    own = decode(model, PROMPTS, config.decode_config(), eos_token_id=[], pad_token_id=0)
    for prompt, generated, blocks in zip(PROMPTS, own.sequences, own.trajectories):
        anchored = anchored_blocks(model, prompt, generated, block_size)
        assert [b.start for b in anchored] == [b.start for b in blocks]
        assert [b.fixed_point for b in anchored] == [b.fixed_point for b in blocks]
        # The decoder stops the last block when its correction is the budget's last token, one forward early.
        assert [b.states for b in anchored[:-1]] == [b.states for b in blocks[:-1]]
        assert len(anchored[-1].states) >= len(blocks[-1].states)


def plain_argmax(model, tokens: list[int]) -> list[int]:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].argmax(-1).tolist()


def test_on_another_text_each_state_follows_from_the_last_and_the_fixed_point_is_the_texts():
    """Every block sits on the reference's prefix; each state is the Jacobi update of the one before under a plain
    causal forward; the model's own fixed point ends the iterates, and the reference's block ends the states."""
    model = tiny_model("llama")
    prompt = PROMPTS[0]
    reference = [(5 * i + 3) % 90 + 10 for i in range(14)]  # text a random model would not write
    blocks = anchored_blocks(model, prompt, reference, 4)
    assert [b.start for b in blocks] == [0, 4, 8, 12]
    appended = 0
    for block in blocks:
        context = prompt + reference[: block.start]
        fixed = reference[block.start : block.start + 4]
        assert block.fixed_point == fixed
        assert block.states[0][0] == plain_argmax(model, context)[-1]  # a draft opens on the model's next token
        own = block.states[:-1] if _appended(model, context, block.states) else block.states
        appended += len(own) < len(block.states)
        for state, after in itertools.pairwise(own):
            predictions = plain_argmax(model, context + state)[len(context) :]
            assert verified(state, predictions) < len(state)
            assert after == next_draft(state, predictions)
        predictions = plain_argmax(model, context + own[-1])[len(context) :]
        assert verified(own[-1], predictions) == len(own[-1])  # the model's own fixed point on this prefix
    assert appended >= 1  # the reference is not the model's text: some block ends at a fixed point it would not reach


def _appended(model, context: list[int], states: list[list[int]]) -> bool:
    """Whether the last state was appended: the state before it is already the model's own fixed point."""
    if len(states) < 2:
        return False
    predictions = plain_argmax(model, context + states[-2])[len(context) :]
    return verified(states[-2], predictions) == len(states[-2])


def test_rows_hold_the_references_prefix_as_context_and_mismatches_against_its_blocks():
    model = tiny_model("qwen2")
    prompts, references = PROMPTS[:2], [[21, 22, 23, 24, 25, 26, 27], [30, 31, 32]]
    table = anchored_trajectories(model, ["a", "b"], prompts, references, TrajectoryConfig(block_size=4), "m", "t")
    expected = []
    for pid, prompt, reference in zip(["a", "b"], prompts, references):
        expected += trajectory_rows(pid, prompt, reference, anchored_blocks(model, prompt, reference, 4), 4, "m", "t")
    assert table.equals(rows_to_table(expected))
    rows = table.to_pylist()
    assert [(r["prompt_id"], r["block_index"], r["last_block"]) for r in rows] == [
        ("a", 0, False),
        ("a", 1, True),
        ("b", 0, True),
    ]
    assert rows[1]["context"] == PROMPTS[0] + [21, 22, 23, 24]
    assert rows[1]["fixed_point"] == [25, 26, 27]
    assert rows[0]["first_mismatch"] == [first_mismatch(s, [21, 22, 23, 24]) for s in rows[0]["states"]]
    assert rows[0]["first_mismatch"][-1] == 4
