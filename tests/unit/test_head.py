"""Only the real queries of a step are projected onto the vocabulary (jfcore/decoding/runner/head.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from jfcore.decoding.runner.head import split_head
from jfcore.decoding.runner.slots import SlotBatch, left_pad
from tests.support.tiny_models import ARCHITECTURES, tiny_model


def _step_logits(model, packed: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A prefill of three ragged prompts, then one step whose rows have 3, 1 and 5 real queries; returns its logits,
    which queries are real, and how many query rows the output head saw in that step."""
    batch = SlotBatch(model, 3)
    tokens, valid, positions = left_pad([[5, 6, 7], [8], [9, 10, 11, 12]], pad=0)
    batch.forward(tokens, valid, positions)
    batch.keep(valid)
    real = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    step_tokens = torch.tensor([[20, 21, 22, 0, 0], [23, 0, 0, 0, 0], [24, 25, 26, 27, 28]])
    step_positions = batch.lengths()[:, None] + torch.arange(5)
    seen: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    )
    try:
        logits = batch.forward(step_tokens, real, step_positions * real, packed=packed)
    finally:
        hook.remove()
    return logits, real, seen


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_packed_step_projects_only_its_real_queries_with_the_same_logits(arch):
    model = tiny_model(arch)
    assert split_head(model) is not None
    whole, real, seen_whole = _step_logits(model, packed=False)
    packed, _, seen_packed = _step_logits(model, packed=True)
    assert seen_whole == [15] and seen_packed == [int(real.sum())] == [9]
    assert packed.shape == (9, whole.shape[-1])
    torch.testing.assert_close(packed, whole[real], rtol=0, atol=1e-5)
    assert torch.equal(packed.argmax(-1), whole[real].argmax(-1))


def test_a_model_whose_forward_changes_the_logits_after_the_head_keeps_its_whole_forward():
    """Gemma 2 soft-caps its logits after the head: its body and head alone would give other values."""
    config = Gemma2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=5.0,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    assert split_head(model) is None
    logits, real, seen = _step_logits(model, packed=True)
    assert logits.shape[:2] == real.shape and seen == [15]
    assert float(logits.abs().max()) <= 5.0  # soft-capped: the model's own forward ran
    config.final_logit_softcapping = None
    assert split_head(Gemma2ForCausalLM(config).eval()) is not None


def test_a_model_in_training_mode_is_not_split():
    model = tiny_model("llama").train()
    assert split_head(model) is None
