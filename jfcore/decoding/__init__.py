"""Lossless greedy decoding: AR, Jacobi, and multiblock with rejection recycling."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from jfcore.decoding.config import DecodeConfig
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.result import BlockTrajectory, DecodeOutput, DecodeStats, StepEvent

__all__ = ["BlockTrajectory", "DecodeConfig", "DecodeOutput", "DecodeStats", "StepEvent", "decode", "special_tokens"]


def decode(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    on_step: Callable[[StepEvent], None] | None = None,
) -> DecodeOutput:
    """Greedy-decode a batch of token-id prompts (any lengths) with `config.method`.

    EOS and PAD default to the model's generation config, as in `generate`.
    The returned sequences hold the new tokens only, up to and including the
    first EOS.
    """
    config = config or DecodeConfig()
    eos, pad = special_tokens(model, eos_token_id, pad_token_id)
    prompts = [list(map(int, p)) for p in prompts]
    return Decoder(model, config, eos, pad, on_step).decode(prompts)


def special_tokens(
    model: torch.nn.Module, eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None
) -> tuple[list[int], int]:
    """EOS ids and a PAD id, falling back to the model's generation config like `generate` does."""
    gen = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(gen, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(gen, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return eos, int(pad_token_id)
