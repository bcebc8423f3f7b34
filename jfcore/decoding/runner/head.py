"""Projecting only the queries a step reads onto the vocabulary.

A decode step pads every row's queries to the widest row's (multiblock rows differ by tens of positions: about
half of a batch's queries are padding), and a causal LM's forward projects every query onto the vocabulary, after
which the greedy choice reads every logit. Where the model is its body followed by its output embedding
(`model.base_model`, then `model.get_output_embeddings()`), a step can run the body and project only the real
queries: the same logits for them, for a fraction of the head's work and of the choice's memory reads.

Whether a model is that is checked once, on a probe, against its own forward: a causal LM whose forward does more
after the projection (final-logit soft-capping or scaling) gives different logits there and keeps its whole
forward.
"""

from __future__ import annotations

import weakref

import torch

_SPLIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SplitHead:
    """A model's body and output head, which together give its forward's logits."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Module):
        self.body, self.head = body, head

    def __call__(self, query_valid: torch.Tensor, **inputs) -> torch.Tensor:
        """Logits [N, V] of the N real queries (`query_valid` [B, Q], row-major order)."""
        hidden = self.body(**inputs).last_hidden_state
        return self.head(hidden[query_valid.to(hidden.device, non_blocking=True)])


def split_head(model: torch.nn.Module) -> SplitHead | None:
    """`model` as body and head if its forward's logits are exactly the head of the body's output (checked once
    per model on a probe, in eval mode); None otherwise."""
    if model.training:
        return None
    if model not in _SPLIT:
        _SPLIT[model] = _probe(model)
    return _SPLIT[model]


@torch.inference_mode()
def _probe(model: torch.nn.Module) -> SplitHead | None:
    body, head = getattr(model, "base_model", None), model.get_output_embeddings()
    if body is None or body is model or head is None:
        return None
    device = next(model.parameters()).device
    tokens = torch.arange(6, device=device).view(2, 3) % model.config.get_text_config().vocab_size
    try:
        split = head(body(input_ids=tokens, use_cache=False).last_hidden_state)
    except (AttributeError, TypeError, ValueError):  # a body that takes other inputs or returns no hidden states
        return None
    whole = model(input_ids=tokens, use_cache=False).logits
    same = split.shape == whole.shape and split.dtype == whole.dtype and torch.equal(split, whole)
    return SplitHead(body, head) if same else None
