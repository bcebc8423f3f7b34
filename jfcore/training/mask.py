"""The noise-aware attention mask (docs/DESIGN.md, section 5).

Two causal streams share the prompt: a query may see an earlier-or-same key
when the key is in the prompt or in the query's own stream. With the packed
order [prompt][k_0][l_0][k_1][l_1]..., that is exactly "noisy sees prompt,
k_<j and its own earlier positions; clean sees prompt, l_<j and its own
earlier positions". PAD keys are never seen; a PAD query sees only itself, so
no softmax row is empty (its output is never scored).

The same rule is built two ways: a dense additive mask for SDPA/eager (CPU,
or short sequences) and a flex-attention BlockMask on GPU, whose sparse block
structure skips the work the dense mask would only zero out.
"""

from __future__ import annotations

import torch

from jfcore.training.batch import PAD, PROMPT


def allowed(streams: torch.Tensor) -> torch.Tensor:
    """Boolean [B, L, L]: may query q attend to key k."""
    L = streams.shape[1]
    q, k = streams[:, :, None], streams[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=streams.device).tril()
    visible = causal & (k != PAD) & (q != PAD) & ((k == PROMPT) | (k == q))
    return visible | torch.eye(L, dtype=torch.bool, device=streams.device)


def dense_mask(streams: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, L, L] mask (0 where allowed, the dtype's minimum elsewhere): what SDPA and eager take."""
    mask = torch.zeros((streams.shape[0], 1, streams.shape[1], streams.shape[1]), dtype=dtype, device=streams.device)
    return mask.masked_fill_(~allowed(streams)[:, None], torch.finfo(dtype).min)


def block_mask(streams: torch.Tensor):
    """The same rule as a flex-attention BlockMask (attn_implementation="flex_attention")."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        q, k = streams[b, q_idx], streams[b, kv_idx]
        visible = (kv_idx <= q_idx) & (k != PAD) & (q != PAD) & ((k == PROMPT) | (k == q))
        return visible | (q_idx == kv_idx)

    B, L = streams.shape
    return create_block_mask(mask_mod, B, None, L, L, device=streams.device)


def attention_mask(streams: torch.Tensor, attn_implementation: str, dtype: torch.dtype):
    """The mask form the model's attention implementation takes."""
    if attn_implementation == "flex_attention":
        return block_mask(streams)
    if attn_implementation in ("sdpa", "eager"):
        return dense_mask(streams, dtype)
    raise ValueError(
        f"attention implementation {attn_implementation!r} cannot take the noise-aware mask; "
        "train with 'flex_attention' (GPU), 'sdpa' or 'eager'"
    )
