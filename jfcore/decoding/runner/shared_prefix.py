"""Rows whose prompts start with the same tokens share that prefix's KV (docs/DESIGN.md, "Shared prompt prefixes").

Requests to a server often open with one system prompt, and few-shot benchmarks with one set of examples. Such a
prefix is prefilled once, its keys and values are kept once per layer ([kv heads, P, head_dim]), and each row's
own cache slots hold only what follows it: prefill work and cache memory for the prefix are paid once, not once
per row, and attention reads the prefix's keys once for all its rows.

Attention over a prefix and the row's own slots is one softmax over both key sets: the scores against the prefix
are one matmul for all of its rows' queries, those against the own slots the usual batched one, and the weights
then meet each key set's values. That is the eager attention's arithmetic over the concatenated keys, summed in
two parts, so its results equal the ordinary forward's to float rounding (a probe checks this once per model).

It goes through transformers' public attention registry: while a batch holds a prefix, the model runs an
attention implementation registered here that wraps the model's own and passes every call without a
`shared_prefix` argument straight to it (with its own mask function), so nothing else changes; the batch
switches the model back when it holds no prefix any more, and `decode` when it returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_WRAPPER = "jf_shared_prefix_over_"
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BASES = ("sdpa",)  # implementations whose calls and masks the wrapper passes on
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks")  # attention variants the split softmax does not do


@dataclass
class Prefix:
    """One shared prefix: its tokens, and each layer's keys and values [kv heads, P, head_dim]."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixRows:
    """Which prefix each row of a batch reads (-1: none); what the attention is given as `shared_prefix`."""

    def __init__(self, prefixes: list[Prefix], of_row: list[int]):
        self.prefixes, self.of_row = prefixes, of_row
        self.lengths = [len(prefixes[p].tokens) if p >= 0 else 0 for p in of_row]
        self.width = max(self.lengths, default=0)
        device = prefixes[0].keys[0].device if prefixes else "cpu"
        # Per prefix: its rows, or None when every row of the batch reads it (no gather needed).
        self.rows: list[torch.Tensor | None] = []
        for p in range(len(prefixes)):
            rows = [b for b, q in enumerate(of_row) if q == p]
            self.rows.append(None if len(rows) == len(of_row) else torch.tensor(rows, device=device))

    def per_row(self) -> list[Prefix | None]:
        """The prefix each row reads (None: none)."""
        return [self.prefixes[p] if p >= 0 else None for p in self.of_row]

    def select(self, rows: Sequence[int]) -> PrefixRows | None:
        """The batch's rows `rows`, in that order; prefixes no row reads are let go."""
        per_row = self.per_row()
        return rows_reading([per_row[r] for r in rows])

    @staticmethod
    def join(first: PrefixRows | None, rows_first: int, second: PrefixRows | None, rows_second: int):
        """The rows of two batches, `first`'s then `second`'s (a prefix both read is kept once)."""
        return rows_reading(
            (first.per_row() if first is not None else [None] * rows_first)
            + (second.per_row() if second is not None else [None] * rows_second)
        )

    def find(self, prompt: Sequence[int]) -> Prefix | None:
        """The longest prefix of this batch that `prompt` starts with and runs past."""
        best = None
        for prefix in self.prefixes:
            n = len(prefix.tokens)
            if len(prompt) > n and tuple(prompt[:n]) == prefix.tokens and (best is None or n > len(best.tokens)):
                best = prefix
        return best


def rows_reading(chosen: Sequence[Prefix | None]) -> PrefixRows | None:
    """`PrefixRows` for rows reading `chosen` prefixes (None: none); None if no row reads one."""
    prefixes: list[Prefix] = []
    for prefix in chosen:
        if prefix is not None and all(prefix is not q for q in prefixes):
            prefixes.append(prefix)
    if not prefixes:
        return None
    return PrefixRows(
        prefixes, [-1 if c is None else next(i for i, q in enumerate(prefixes) if q is c) for c in chosen]
    )


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every prompt starts with, leaving each at least one token of its own (the
    prefill's last position gives the row's first token)."""
    shortest = min(len(p) for p in prompts)
    n = 0
    first = prompts[0]
    while n < shortest - 1 and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def supported(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention can read a shared prefix: its implementation is SDPA (whose mask function this
    module reads), and on a probe a prompt decoded over its own first tokens as a shared prefix gives the logits
    its ordinary forward gives (checked once per model)."""
    if model.training or _implementation(model).removeprefix(_WRAPPER) not in _BASES:
        return False
    if model not in _PROBED:
        _PROBED[model] = _probe(model)
    return _PROBED[model]


def prefill(model: torch.nn.Module, tokens: Sequence[int], **model_kwargs) -> Prefix:
    """Run `tokens` alone through `model` and keep their keys and values."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([list(tokens)], device=device), past_key_values=cache, use_cache=True, **model_kwargs)
    return Prefix(tuple(tokens), [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers])


def use_wrapper(model: torch.nn.Module) -> None:
    """Switch `model` to the wrapping attention (calls without `shared_prefix` are its own attention's); nothing
    to do if it runs it already. Switching walks the model's modules (~0.4 ms for 30 layers), so a batch switches
    once, when it first holds a prefix, and `restore`s when it no longer does."""
    base = _implementation(model)
    if base.startswith(_WRAPPER):
        return
    name = _WRAPPER + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        own = ALL_ATTENTION_FUNCTIONS[base]

        def attention(module, query, key, value, attention_mask, *args, shared_prefix=None, **kwargs):
            if shared_prefix is None:
                return own(module, query, key, value, attention_mask, *args, **kwargs)
            return attend(module, query, key, value, attention_mask, shared_prefix, *args, **kwargs)

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)


def restore(model: torch.nn.Module) -> None:
    """Switch `model` back to its own attention implementation, if it runs the wrapper."""
    name = _implementation(model)
    if name.startswith(_WRAPPER):
        model.set_attn_implementation(name.removeprefix(_WRAPPER))


def _implementation(model: torch.nn.Module) -> str:
    """The name of `model`'s attention implementation ("" for a config that names none)."""
    return model.config._attn_implementation or ""


@torch.inference_mode()
def _probe(model: torch.nn.Module) -> bool:
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    tokens = (torch.arange(12, device=device).view(2, 6) * 7 + 3) % vocab
    tokens[1, :3] = tokens[0, :3]
    whole = model(input_ids=tokens).logits[:, 3:].float()
    prefix = prefill(model, tokens[0, :3].tolist())
    cache = DynamicCache(config=model.config)
    positions = torch.arange(3, 6, device=device).expand(2, -1)
    use_wrapper(model)
    try:
        split = model(
            input_ids=tokens[:, 3:],
            position_ids=positions,
            past_key_values=cache,
            shared_prefix=PrefixRows([prefix], [0, 0]),
        ).logits.float()
    except (TypeError, ValueError):  # an attention with variants the split softmax does not do
        return False
    finally:
        restore(model)
    tolerance = 1e-4 if whole.dtype == torch.float32 else 3e-2
    return torch.allclose(split, whole, rtol=tolerance, atol=tolerance * float(whole.abs().max()))


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    shared: PrefixRows,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of `query` [B, H, Q, D] over each row's prefix (all of it: it precedes every query) and its own
    slots `key`/`value` [B, Hkv, L, D] under `attention_mask` (additive, boolean, or None for causal). Returns
    the output [B, Q, H, D]."""
    unsupported = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if unsupported or (module.training and dropout):
        raise ValueError(f"shared prompt prefixes do not support attention with {unsupported or 'dropout'}")
    rows, heads, q, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    low = torch.finfo(query.dtype).min
    grouped = query.reshape(rows, kv_heads, groups * q, dim)  # heads h = kv * groups + g, as repeat_kv lays them out
    own = torch.matmul(grouped, key.transpose(2, 3)).view(rows, kv_heads, groups, q, length) * scaling
    own = own + _additive(attention_mask, rows, q, length, query.dtype, query.device)[:, :, None]
    scores = torch.full((rows, kv_heads, groups, q, shared.width + length), low, dtype=query.dtype, device=query.device)
    scores[..., shared.width :] = own
    layer = module.layer_idx
    for prefix, members in zip(shared.prefixes, shared.rows):
        p = len(prefix.tokens)
        mine = grouped if members is None else grouped[members]
        flat = mine.transpose(0, 1).reshape(kv_heads, -1, dim)  # [Hkv, rows*groups*q, D]: one matmul per prefix
        part = torch.matmul(flat, prefix.keys[layer].transpose(1, 2)) * scaling
        part = part.view(kv_heads, -1, groups, q, p).transpose(0, 1)
        if members is None:
            scores[..., :p] = part
        else:
            scores[members, ..., :p] = part
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights[..., shared.width :].reshape(rows, kv_heads, groups * q, length), value)
    for prefix, members in zip(shared.prefixes, shared.rows):
        p = len(prefix.tokens)
        mine = weights[..., :p] if members is None else weights[members, ..., :p]
        flat = mine.transpose(0, 1).reshape(kv_heads, -1, p)
        part = torch.matmul(flat, prefix.values[layer]).view(kv_heads, -1, groups * q, dim).transpose(0, 1)
        if members is None:
            out += part
        else:
            out.index_add_(0, members, part)
    return out.view(rows, heads, q, dim).transpose(1, 2).contiguous(), None


def _additive(
    mask: torch.Tensor | None, rows: int, q: int, length: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[B, 1, Q, L] additive mask from the model's mask function's output (None: causal, ending at the last slot)."""
    if mask is None:
        allowed = torch.ones(q, length, dtype=torch.bool, device=device).tril(length - q)
        mask = allowed.expand(rows, 1, q, length)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask[..., :length].to(dtype)
