"""Distillation training: packed batches, the noise-aware mask, the losses and the DeepSpeed loop."""

from jfcore.training.batch import CLEAN, NOISY, PAD, PROMPT, PackedBatch, collate
from jfcore.training.losses import Losses, ar_loss, consistency_loss, jacobi_forcing_loss
from jfcore.training.mask import allowed, attention_mask, block_mask, dense_mask

__all__ = [
    "CLEAN",
    "NOISY",
    "PAD",
    "PROMPT",
    "Losses",
    "PackedBatch",
    "allowed",
    "ar_loss",
    "attention_mask",
    "block_mask",
    "collate",
    "consistency_loss",
    "dense_mask",
    "jacobi_forcing_loss",
]
