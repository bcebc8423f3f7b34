"""The noise-aware attention mask (docs/DESIGN.md, section 5).

Two causal streams share the prompt: a query may see an earlier-or-same key
when the key is in the prompt or in the query's own stream. With the packed
order [prompt][k_0][l_0][k_1][l_1]..., that is exactly "noisy sees prompt,
k_<j and its own earlier positions; clean sees prompt, l_<j and its own
earlier positions". PAD keys are never seen; a PAD query sees only itself, so
no softmax row is empty (its output is never scored).

That is the `noisy` context, the published one: a noisy block sees the earlier
blocks' noisy states, as a later block of multiblock decoding sees the drafts
before it. With the `clean` context a noisy block k_j sees l_<j instead (and
k_j's own earlier positions): the fixed points before it, as a single Jacobi
block sees its committed text.

The same rule is built two ways: a dense additive mask for SDPA/eager (CPU,
or short sequences) and a flex-attention BlockMask on GPU, whose sparse block
structure skips the work the dense mask would only zero out.
"""

from __future__ import annotations

from typing import Literal

import torch

from jfcore.training.batch import CLEAN, NOISY, PAD, PROMPT

NoisyContext = Literal["noisy", "clean"]


def _rule(q, k, bq, bk, context: NoisyContext):
    """May a query of stream q (block bq) see an earlier-or-same key of stream k (block bk); elementwise."""
    own = k == q
    if context == "clean":  # a noisy query: its own block's noisy keys, and the clean keys of earlier blocks
        noisy = q == NOISY
        own = (own & (~noisy | (bk == bq))) | (noisy & (k == CLEAN) & (bk < bq))
    return (k != PAD) & (q != PAD) & ((k == PROMPT) | own)


def allowed(streams: torch.Tensor, blocks: torch.Tensor | None = None, context: NoisyContext = "noisy") -> torch.Tensor:
    """Boolean [B, L, L]: may query q attend to key k (`blocks`, PackedBatch.blocks, for the clean context)."""
    L = streams.shape[1]
    bq, bk = (None, None) if blocks is None else (blocks[:, :, None], blocks[:, None, :])
    causal = torch.ones(L, L, dtype=torch.bool, device=streams.device).tril()
    visible = causal & _rule(streams[:, :, None], streams[:, None, :], bq, bk, context)
    return visible | torch.eye(L, dtype=torch.bool, device=streams.device)


def dense_mask(
    streams: torch.Tensor, dtype: torch.dtype, blocks: torch.Tensor | None = None, context: NoisyContext = "noisy"
) -> torch.Tensor:
    """Additive [B, 1, L, L] mask (0 where allowed, the dtype's minimum elsewhere): what SDPA and eager take."""
    mask = torch.zeros((streams.shape[0], 1, streams.shape[1], streams.shape[1]), dtype=dtype, device=streams.device)
    return mask.masked_fill_(~allowed(streams, blocks, context)[:, None], torch.finfo(dtype).min)


def block_mask(streams: torch.Tensor, blocks: torch.Tensor | None = None, context: NoisyContext = "noisy"):
    """The same rule as a flex-attention BlockMask (attn_implementation="flex_attention")."""
    from torch.nn.attention.flex_attention import create_block_mask

    blocks = streams if blocks is None else blocks.long()  # the noisy context reads no block (any tensor will do)

    def mask_mod(b, h, q_idx, kv_idx):
        rule = _rule(streams[b, q_idx], streams[b, kv_idx], blocks[b, q_idx], blocks[b, kv_idx], context)
        return ((kv_idx <= q_idx) & rule) | (q_idx == kv_idx)

    B, L = streams.shape
    return create_block_mask(mask_mod, B, None, L, L, device=streams.device)


def attention_mask(
    streams: torch.Tensor,
    attn_implementation: str,
    dtype: torch.dtype,
    blocks: torch.Tensor | None = None,
    context: NoisyContext = "noisy",
):
    """The mask form the model's attention implementation takes."""
    if context == "clean" and blocks is None:
        raise ValueError("the clean context needs each token's block (PackedBatch.blocks)")
    if attn_implementation == "flex_attention":
        return block_mask(streams, blocks, context)
    if attn_implementation in ("sdpa", "eager"):
        return dense_mask(streams, dtype, blocks, context)
    raise ValueError(
        f"attention implementation {attn_implementation!r} cannot take the noise-aware mask; "
        "train with 'flex_attention' (GPU), 'sdpa' or 'eager'"
    )
