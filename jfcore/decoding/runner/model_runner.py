"""The model side of decoding: how a batch's forwards run (eager, compiled or CUDA graphs; the CPU linear kernels),
which prompt prefixes rows may share, and the prefill's settings. The scheduler asks it for slot batches
(jfcore/decoding/runner/slots.py) and shared prefixes; it knows nothing of rows or rules."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

from jfcore.decoding.config import DecodeConfig
from jfcore.decoding.runner import shared_prefix
from jfcore.decoding.runner.compiled import fixed_forward
from jfcore.decoding.runner.linear import FasterLinear, faster_linear
from jfcore.decoding.runner.slots import SlotBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: DecodeConfig):
        self.model = model
        self.linear_mode = config.linear
        self.fixed_forward = fixed_forward(model, config.compile)
        # Prompt prefixes shared between rows are read by an eager attention: fixed-shape forwards keep their own.
        self.share_prefix_tokens = config.share_prefix_tokens if self.fixed_forward is None else 0
        # Prefill needs only the last position's logits: skip the vocabulary projection elsewhere.
        takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.prefill_kwargs = {"logits_to_keep": 1} if takes_keep else {}

    @functools.cached_property
    def linear(self) -> FasterLinear | None:
        """Eager forwards' linear layers: torch's kernels, or where measured faster the weight-first product.
        Resolved at the first forward, so that the probe runs on the thread that decodes (jf-serve's engine thread,
        not the one that built the decoder: docs/DESIGN.md, "Linear layers on a CPU")."""
        return faster_linear(self.model, self.linear_mode) if self.fixed_forward is None else None

    def slots(self, rows: int) -> SlotBatch:
        """An empty slot batch of `rows` rows, forwarding as this runner does."""
        return SlotBatch(self.model, rows, fixed_forward=self.fixed_forward, linear=self.linear)

    def shares_prefixes(self, prompts: Sequence[Sequence[int]]) -> bool:
        """Whether these prompts may read shared prefixes: sharing is on, one runs past the minimum, and the
        model's attention can read one (probed once per model)."""
        minimum = self.share_prefix_tokens
        return bool(minimum) and any(len(p) > minimum for p in prompts) and shared_prefix.supported(self.model)

    def prefill_prefix(self, tokens: Sequence[int]) -> shared_prefix.Prefix:
        """A prefix's keys and values, prefilled once for the rows that read it."""
        return shared_prefix.prefill(self.model, tokens, **self.prefill_kwargs)

    def restore(self) -> None:
        """The model's own attention again (no shared prefix left to read; see runner/shared_prefix.py)."""
        shared_prefix.restore(self.model)
