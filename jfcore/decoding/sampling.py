"""Sampling as a deterministic function of the prefix: Gumbel-max with counter-based noise (docs/DESIGN.md,
section 1, "Sampling").

The token at generated position t of sample s is

    argmax_v [ warp(logits_t / T)_v + G(seed, s, t, v) ]

where `warp` applies top-k, then top-p to the temperature-scaled logits (transformers' order: temperature, top-k,
top-p; removed tokens get -inf) and G is standard Gumbel noise computed from a hash of (seed, s, t, v): no
generator state, only a counter. By the Gumbel-max theorem the token is distributed exactly as softmax(warp(...)),
independently per position (distinct keys give independent noise). And because it depends only on the logits at
t (a function of the prefix) and on the key, it is a deterministic function of the prefix, just like the greedy
argmax: Jacobi verification (draft[i+1] == choice after draft[:i+1]) accepts exactly the tokens sequential
sampling would produce, so every method returns the same tokens as AR sampling with the same seed.
Temperature 0 is greedy (plain argmax, no noise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from jfcore.config import check

_MASK64 = (1 << 64) - 1
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser constants


@dataclass(frozen=True)
class Sampling:
    """How one row chooses its tokens. temperature 0: greedy; top_k 0 and top_p 1: off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.temperature >= 0.0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        check(self.top_k >= 0, f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor, in place (multiplication wraps modulo 2**64 like uint64)."""
    x ^= _shr(x, 30)
    x *= _signed(_M1)
    x ^= _shr(x, 27)
    x *= _signed(_M2)
    x ^= _shr(x, 31)
    return x


def mix64(x: int) -> int:
    """The same finaliser on a Python integer."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def noise_bits_of(seed: int, sample: int, position: int, token: int) -> int:
    """`noise_bits` for one (seed, sample, position, token), in plain integers (the tests' reference)."""
    return mix64(mix64(mix64(mix64(seed) ^ sample) ^ position) ^ token)


def noise_keys(seed: torch.Tensor, sample: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[B, Q] int64 key of (seed[b], sample[b], position[b, q])."""
    return _mix(_mix(_mix(seed.clone()) ^ sample)[:, None] ^ position)


def noise_bits(seed: torch.Tensor, sample: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, Q, V] int64 hash of (seed[b], sample[b], position[b, q], v): the counter behind the noise."""
    keys = noise_keys(seed, sample, position)
    return _mix(keys[..., None] ^ torch.arange(vocab, device=keys.device))


def gumbel(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float64 standard Gumbel noise of `tokens` under `keys` (broadcast together), a pure function of both."""
    uniform = _shr(_mix(keys ^ tokens), 11).double()
    return uniform.add_(0.5).mul_(2.0**-53).log_().neg_().log_().neg_()  # u in (0, 1); -log(-log u)


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p, per row ([B] parameters, logits [B, Q, V]), as transformers' logits
    warpers do them, over the whole vocabulary; removed tokens get -inf. float64. (`choose` reaches the same
    choice looking at the top candidates only; the tests hold the two equal.)"""
    scores = logits.double() / temperature[:, None, None]
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((k < vocab).any()):
        kth = scores.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None, None].expand(-1, scores.shape[1], 1))
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if bool((top_p < 1).any()):
        ordered, order = scores.sort(dim=-1)  # ascending
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)[:, None, None]
        drop[..., -1:] = False  # at least one token stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    return scores


TWO_PASS_LOGITS = 1 << 19  # from this many logits on, `greedy_argmax` takes its two passes


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.max(-1).indices` (the first index of the largest value), on a CPU in two passes: each chunk's maximum
    over the vocabulary cut into about sqrt(V) chunks, then the first index of the largest within the first chunk
    that holds it. Values only, then one small chunk, is much cheaper there than max with indices over the whole
    vocabulary (measured in bench/published/engine-cpu/2026-11-26b/: 1.4x at [64, 42, 2048], 3-6x at SmolLM2's 49152)."""
    vocab = logits.shape[-1]
    chunk = 1 << max(5, round(math.log2(vocab) / 2))
    # Small: one pass is cheaper.
    if logits.device.type != "cpu" or vocab < 4 * chunk or logits.numel() < TWO_PASS_LOGITS:
        return logits.max(-1).indices
    whole = vocab - vocab % chunk
    chunks = logits[..., :whole].unflatten(-1, (whole // chunk, chunk))
    peak, first = chunks.amax(-1).max(-1)
    start = first * chunk
    within = torch.arange(chunk, device=logits.device)
    index = start + logits.gather(-1, start[..., None] + within).max(-1).indices
    if whole == vocab:
        return index
    rest, at = logits[..., whole:].max(-1)  # the vocabulary's tail: it wins only if strictly larger (or a NaN)
    later = (rest > peak) | (rest.isnan() & ~peak.isnan())
    return torch.where(later, whole + at, index)


def choose(
    logits: torch.Tensor,
    settings: Sequence[Sampling],
    samples: Sequence[int],
    positions: torch.Tensor | Callable[[], torch.Tensor],
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's token choice at every query position: logits [B, Q, V] (or [N, V]: only the N real queries that
    `valid` [B, Q] marks, in row-major order; padding queries then choose 0), one `Sampling` and sample index per
    row, positions [B, Q] (generated position of the token each query predicts; a callable is called only when some
    row samples, so greedy steps build none). Returns [B, Q] token ids on the host."""
    sampled = [b for b, s in enumerate(settings) if not s.greedy]
    if logits.dim() == 2:  # packed
        where = valid.to(logits.device)
        greedy = torch.zeros(where.shape, dtype=torch.long, device=logits.device).masked_scatter_(
            where, greedy_argmax(logits)
        )
        if sampled:
            logits = logits.new_zeros((*where.shape, logits.shape[-1])).index_put_((where,), logits)
    else:
        greedy = greedy_argmax(logits)
    if not sampled:
        return greedy.cpu()
    positions = positions() if callable(positions) else positions
    device = logits.device
    rows = torch.tensor(sampled, device=device)

    def column(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(settings[b], name) for b in sampled], dtype=dtype, device=device)

    top_k, top_p = column("top_k", torch.long), column("top_p", torch.float64)
    temperature = column("temperature", torch.float64)
    picked = logits if len(sampled) == len(settings) else logits[rows]
    seed = torch.tensor([_signed(settings[b].seed & _MASK64) for b in sampled], device=device)
    sample = torch.tensor([samples[b] for b in sampled], device=device)
    keys = noise_keys(seed, sample, positions.to(device)[rows])
    plain = (top_k == 0) & (top_p >= 1)
    if bool(plain.all()):  # every token can win: noise for the whole vocabulary
        chosen = _plain_choice(picked, temperature, keys)
    elif not bool(plain.any()):
        chosen = _filtered_choice(picked, temperature, keys, top_k, top_p)
    else:
        chosen = torch.empty(picked.shape[:2], dtype=torch.long, device=device)
        chosen[plain] = _plain_choice(picked[plain], temperature[plain], keys[plain])
        filtered = ~plain
        chosen[filtered] = _filtered_choice(
            picked[filtered], temperature[filtered], keys[filtered], top_k[filtered], top_p[filtered]
        )
    greedy[rows] = chosen
    return greedy.cpu()


def _plain_choice(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    scores = logits.double().div_(temperature[:, None, None])
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    return scores.add_(gumbel(keys[..., None], vocab)).argmax(-1)


def _filtered_choice(
    logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """argmax of the top-k / top-p filtered scores plus noise, with noise computed only for the highest-scoring
    candidates: enough of them to hold every token the filters keep (more are taken until they do). Equal to
    `warp` then noise over the whole vocabulary, token for token, since removed tokens cannot win."""
    vocab = logits.shape[-1]
    limited = top_k > 0
    width = min(vocab, max([64, *top_k[limited].tolist()]))  # every top-k token is a candidate (ties: below)
    scale = temperature[:, None, None]
    # Top-p without top-k normalises over the whole vocabulary (with top-k, over the top-k tokens).
    whole = ~limited & (top_p < 1)
    everything = torch.zeros(logits.shape[:2], dtype=torch.float64, device=logits.device)
    if bool(whole.any()):
        everything[whole] = (logits[whole].double() / scale[whole]).logsumexp(-1)
    while True:
        tokens = logits.topk(width, dim=-1).indices  # the order of logits / T, T > 0
        values = logits.gather(-1, tokens).double() / scale  # descending
        keep = torch.ones_like(values, dtype=torch.bool)
        tied_beyond = torch.zeros(logits.shape[:2], dtype=torch.bool, device=logits.device)
        if bool(limited.any()):
            kth = values.gather(-1, (top_k.clamp(1, width) - 1)[:, None, None].expand(-1, values.shape[1], 1))
            keep &= ~limited[:, None, None] | (values >= kth)
            # Top-k keeps every token tied with the k-th (as transformers does): while the last candidate ties
            # it, tokens beyond the candidates may too.
            tied_beyond = limited[:, None] & (values[..., -1] >= kth[..., 0])
        # Top-p over the top-k survivors: a token stays while the mass ranked above it is below p.
        normaliser = torch.where(limited[:, None], values.masked_fill(~keep, -torch.inf).logsumexp(-1), everything)
        probs = (values - normaliser[..., None]).exp().masked_fill(~keep, 0.0)
        above = probs.cumsum(-1) - probs
        keep &= above < top_p[:, None, None]
        # Covered: the first token outside the candidates would be removed: top-k removes it unless it may tie the
        # k-th (then the top-k normaliser is incomplete too), else top-p does once the candidates hold mass p.
        covered = torch.where(limited[:, None], ~tied_beyond, probs.sum(-1) >= top_p[:, None]) | (width == vocab)
        if bool(covered.all()):
            noisy = (values + gumbel(keys[..., None], tokens)).masked_fill(~keep, -torch.inf)
            return tokens.gather(-1, noisy.argmax(-1, keepdim=True)).squeeze(-1)
        width = min(vocab, width * 4)
