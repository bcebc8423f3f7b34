"""Sampling (jfcore/decoding/sampling.py): every method returns sequential sampling's tokens, and those tokens
follow the model's warped distribution exactly."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jfcore.config import ConfigError
from jfcore.decoding import DecodeConfig, decode
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.reference import sample_sequentially
from jfcore.decoding.sampling import (
    Sampling,
    choose,
    greedy_argmax,
    gumbel,
    noise_bits,
    noise_bits_of,
    noise_keys,
    warp,
)
from tests.support.tiny_models import tiny_model

METHODS = {
    "ar": {"method": "ar"},
    "jacobi n4": {"method": "jacobi", "block_size": 4},
    "jacobi n3 + lookup": {"method": "jacobi", "block_size": 3, "lookup_tokens": 3, "lookup_ngram": 1},
    "multiblock n3": {"method": "multiblock", "block_size": 3, "num_blocks": 2, "pool_size": 2, "ngram_size": 3},
}
# Checked token for token against sequential sampling (the distribution test runs METHODS): AR with a copied
# candidate runs as batch tensors from 8 rows, a code path of its own.
EXACT_METHODS = {**METHODS, "ar + lookup": {"method": "ar", "lookup_tokens": 3, "lookup_ngram": 1}}


def _config(method: str, sampling: Sampling, max_new_tokens: int) -> DecodeConfig:
    return DecodeConfig(
        **EXACT_METHODS[method],
        max_new_tokens=max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        sample_seed=sampling.seed,
    )


@pytest.mark.parametrize("vocab", [2048, 2049, 49152, 50257])
def test_the_two_pass_greedy_choice_is_the_first_index_of_the_largest_logit(vocab):
    """`greedy_argmax` equals `max(-1).indices` wherever it takes its two passes (vocabularies cut evenly into
    chunks or with a remainder), on ties (the first index wins, also across chunks and into the remainder) and
    NaN (a NaN wins, as in `max`)."""
    rng = random.Random(vocab)
    rows = (1 << 19) // (4 * vocab) + 1  # enough logits for the two-pass path
    for case in range(9):
        logits = torch.randn(rows, 4, vocab) if case % 3 else torch.randint(0, 3, (rows, 4, vocab)).float()
        top = logits.amax()
        for b, q in [(0, 0), (0, 3), (rows - 1, 2)]:  # equal maxima at two places, one of them maybe the last token
            for at in (rng.randrange(vocab), rng.choice([vocab - 1, rng.randrange(vocab)])):
                logits[b, q, at] = top + 1
        if case == 4:
            logits[0, 1, rng.randrange(vocab)] = float("nan")
            logits[0, 2, vocab - 1] = float("nan")
        assert torch.equal(greedy_argmax(logits), logits.max(-1).indices)


def test_the_noise_counter_is_the_plain_integer_hash():
    """The tensor hash (int64 with wrapping products and logical shifts) equals the same hash on Python integers,
    for seeds that use all 64 bits."""
    rng = random.Random(0)
    seeds = [rng.randrange(1 << 64) for _ in range(4)]
    signed = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds])
    samples = torch.tensor([0, 1, 7, 123456])
    positions = torch.tensor([[0, 1, 2], [5, 9, 1000], [3, 3, 3], [0, 77, 4096]])
    bits = noise_bits(signed, samples, positions, 11)
    for b, q, v in itertools.product(range(4), range(3), range(11)):
        expected = noise_bits_of(seeds[b], int(samples[b]), int(positions[b, q]), v)
        assert int(bits[b, q, v]) & ((1 << 64) - 1) == expected


def test_noise_for_the_filtered_candidates_only_picks_what_noise_for_every_token_picks():
    """`choose` draws noise only for the top-scoring candidates that top-k / top-p keep (growing the candidates when
    a flat distribution needs more): the same tokens as warping the whole vocabulary and adding noise everywhere."""
    rng = torch.Generator().manual_seed(0)
    vocab, rows, width = 5000, 12, 3
    for case in range(8):
        logits = torch.randn(rows, width, vocab, generator=rng) * (0.3 if case % 2 else 4.0)  # flat or peaked
        settings = [
            Sampling(
                temperature=[0.5, 1.0, 1.7][b % 3], top_k=[0, 5, 300, 0][b % 4], top_p=[1.0, 0.9, 0.5][b % 3], seed=b
            )
            for b in range(rows)
        ]
        positions = torch.randint(0, 1000, (rows, width), generator=rng)
        got = choose(logits, settings, list(range(rows)), positions)
        seed = torch.tensor([s.seed for s in settings])
        scores = warp(
            logits,
            torch.tensor([s.temperature for s in settings], dtype=torch.float64),
            torch.tensor([s.top_k for s in settings]),
            torch.tensor([s.top_p for s in settings], dtype=torch.float64),
        )
        keys = noise_keys(seed, torch.arange(rows), positions)
        expected = (scores + gumbel(keys[..., None], torch.arange(vocab))).argmax(-1)
        assert torch.equal(got, expected), case


def test_top_k_keeps_every_token_tied_with_the_kth():
    """200 tokens share the top logit (common in bfloat16) and top_k is 5: top-k keeps all 200, as transformers'
    warper does, so draws spread over all of them; beside them, peaked rows with top-k and top-p. `choose` (which
    looks at the top candidates only) picks what warping the whole vocabulary then adding noise picks."""
    vocab, rows, width, tied = 1000, 6, 50, 200
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, width, vocab, generator=rng).mul_(0.1).sub_(5.0)
    logits[..., 100 : 100 + tied] = 2.0  # the same top value, bfloat16-exact
    logits[3:, :, 100] = 3.0  # rows 3-5: one token above the tie, so the 5th is still in it
    logits[4, :, 100] = 10.0  # row 4: that token holds over 0.9 of the mass, so top-p 0.9 keeps it alone
    # (Which of the tied tokens a top-p cut inside the tie keeps depends on sort order, in transformers too.)
    settings = [
        Sampling(temperature=1.0, top_k=[5, 5, 1, 5, 5, 2][b], top_p=[1.0, 1.0, 1.0, 1.0, 0.9, 1.0][b], seed=b)
        for b in range(rows)
    ]
    top_k = torch.tensor([s.top_k for s in settings])
    warped = warp(logits, torch.ones(rows, dtype=torch.float64), top_k, torch.tensor([s.top_p for s in settings]))
    reference = TopKLogitsWarper(5)(None, logits[0].double())
    assert torch.equal(warped[0].isfinite(), reference.isfinite())
    assert int(warped[0, 0].isfinite().sum()) == tied

    positions = torch.arange(width).repeat(rows, 1)
    got = choose(logits, settings, list(range(rows)), positions)
    keys = noise_keys(torch.tensor([s.seed for s in settings]), torch.arange(rows), positions)
    expected = (warped + gumbel(keys[..., None], torch.arange(vocab))).argmax(-1)
    assert torch.equal(got, expected)
    assert bool(((got >= 100) & (got < 100 + tied)).all()) and bool((got[4] == 100).all())
    # 50 draws from 200 equally likely tokens reach past the first 64 of them (a cut at 64 never could).
    assert int((got[0] >= 164).sum()) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_every_method_returns_the_tokens_of_sequential_sampling(arch):
    """For random seeds and settings: AR, Jacobi, Jacobi and AR with prompt lookup and multiblock, row by row and
    (AR and Jacobi from 8 rows) as batch tensors, return exactly the tokens of token-by-token sampling with the same
    keys."""
    m = tiny_model(arch)
    rng = random.Random(arch)
    accepted_runs = differs_from_greedy = 0
    for case in range(6):
        rows = rng.choice([1, 3, 9])
        prompts = [[rng.randrange(1, 96) for _ in range(rng.randrange(1, 9))] for _ in range(rows)]
        sampling = Sampling(
            temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
            top_k=rng.choice([0, 3, 20]),
            top_p=rng.choice([1.0, 0.9, 0.6]),
            seed=rng.randrange(1 << 63),
        )
        reference = [sample_sequentially(m, p, 14, sampling, sample=i) for i, p in enumerate(prompts)]
        greedy = decode(m, prompts, DecodeConfig(method="ar", max_new_tokens=14)).sequences
        differs_from_greedy += sum(r != g for r, g in zip(reference, greedy))
        for method in EXACT_METHODS:
            out = decode(m, prompts, _config(method, sampling, 14))
            assert out.sequences == reference, (case, method, sampling)
            if method != "ar":
                accepted_runs += out.stats.new_tokens > out.stats.decode_forwards + rows
    assert differs_from_greedy > 0  # sampling really sampled
    assert accepted_runs > 0  # and some forwards accepted several sampled tokens at once


@pytest.mark.parametrize("method", ["jacobi n4", "ar + lookup"])
@pytest.mark.parametrize("rules", ["native", "python"])
def test_rows_with_their_own_settings_share_a_batch(rules, method):
    """A batch mixing greedy rows and sampled rows with their own temperature, top-k, top-p, seed and sample index
    (as a server's requests do), with a row joining mid-decode: each row gets its own sequential-sampling tokens,
    with the C rules and with the Python ones."""
    m = tiny_model("qwen3")
    rng = random.Random(5)
    keys = [
        (Sampling(), 0),
        (Sampling(temperature=0.8, seed=1), 0),
        (Sampling(temperature=0.8, seed=1), 1),
        (Sampling(temperature=1.2, top_k=4, seed=2), 0),
        (Sampling(temperature=0.5, top_p=0.7, seed=3), 7),
        (Sampling(), 0),
        (Sampling(temperature=1.0, top_k=10, top_p=0.9, seed=4), 2),
        (Sampling(temperature=0.9, seed=5), 0),
    ]
    prompts = [[rng.randrange(1, 96) for _ in range(rng.randrange(2, 9))] for _ in keys]
    live = Decoder(m, DecodeConfig(**EXACT_METHODS[method], max_new_tokens=12), [], 0, rules=rules).scheduler()
    rows = live.add(prompts[:-1], None, keys[:-1])
    live.step()
    rows += live.add(prompts[-1:], None, keys[-1:])
    while live.rows:
        live.step()
    for row, prompt, (sampling, sample) in zip(rows, prompts, keys):
        assert row.out == sample_sequentially(m, prompt, 12, sampling, sample), (sampling, sample)


def test_identical_prompts_are_prefilled_once():
    """A request's n choices join as identical prompts: one prefill row serves them all, and each choice still gets
    its own sequential-sampling tokens (a greedy row beside them too)."""
    m = tiny_model("llama")
    prompt, other = [5, 9, 2, 7], [3, 3, 8]
    prompts = [prompt, prompt, prompt, other, prompt]
    sampled = Sampling(temperature=1.0, seed=3)
    keys = [(sampled, 0), (sampled, 1), (sampled, 2), (Sampling(), 0), (Sampling(), 0)]
    prefill_rows: list[int] = []
    hook = m.register_forward_pre_hook(
        lambda module, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        live = Decoder(m, DecodeConfig(method="jacobi", block_size=3, max_new_tokens=10), [], 0).scheduler()
        rows = live.add(prompts, None, keys)
        while live.rows:
            live.step()
    finally:
        hook.remove()
    assert prefill_rows[0] == 2  # two distinct prompts
    for row, p, (sampling, sample) in zip(rows, prompts, keys):
        assert row.out == sample_sequentially(m, p, 10, sampling, sample), (p, sampling, sample)
    assert len({tuple(r.out) for r in rows[:3]}) > 1  # the choices are samples of their own


def test_a_sample_index_and_a_seed_each_change_the_tokens():
    m = tiny_model("llama")
    prompt = [5, 9, 2, 7]
    base = Sampling(temperature=1.0, seed=1)
    first = sample_sequentially(m, prompt, 12, base, sample=0)
    assert first == sample_sequentially(m, prompt, 12, base, sample=0)
    assert first != sample_sequentially(m, prompt, 12, base, sample=1)
    assert first != sample_sequentially(m, prompt, 12, Sampling(temperature=1.0, seed=2), sample=0)


def test_bad_sampling_settings_name_the_field():
    for kwargs, field in (({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k")):
        with pytest.raises(ConfigError, match=field):
            DecodeConfig(**kwargs)
    with pytest.raises(ConfigError, match="record_trajectories needs temperature 0"):
        DecodeConfig(record_trajectories=True, temperature=0.7)


# -- the distribution ------------------------------------------------------------------------------------------------

VOCAB, LENGTH, SAMPLES, CHUNK = 8, 3, 50_000, 10_000  # per method and setting: 1e5 per method
SETTINGS = [
    Sampling(temperature=0.7, top_k=6, top_p=0.9, seed=11),
    Sampling(temperature=1.0, top_k=5, top_p=0.95, seed=12),
]


def _vocab8_model() -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


@torch.inference_mode()
def _exact_distribution(model, prompt: list[int], sampling: Sampling) -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation of LENGTH tokens, from the model's probabilities warped by
    transformers' own warpers (temperature, top-k, top-p)."""
    warpers = LogitsProcessorList(
        [
            TemperatureLogitsWarper(sampling.temperature),
            TopKLogitsWarper(sampling.top_k),
            TopPLogitsWarper(sampling.top_p),
        ]
    )
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(LENGTH):
        grown = {}
        for prefix, p in probs.items():
            ids = torch.tensor([[*prompt, *prefix]])
            logits = model(ids).logits[:, -1].double()
            step = warpers(ids, logits).softmax(-1)[0]
            grown.update({(*prefix, v): p * float(step[v]) for v in range(VOCAB) if step[v] > 0})
        probs = grown
    return probs


def _chi_square_p(observed: dict, expected: dict[tuple[int, ...], float], n: int) -> float:
    """p-value of Pearson's chi-square test; continuations expected fewer than 5 times are pooled into one cell."""
    assert set(observed) <= set(expected), "a continuation with probability 0 was sampled"
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for outcome, p in expected.items():
        if n * p >= 5:
            cells.append((observed.get(outcome, 0), n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + observed.get(outcome, 0), pooled_exp + n * p
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def test_sampled_continuations_follow_the_exact_distribution():
    """1e5 samples of a 3-token continuation per method, half at each setting (temperature 0.7 and 1.0, each with
    top-k and top-p), a vocabulary of 8: Pearson's chi-square against the distribution enumerated from the model's
    probabilities, Bonferroni-corrected over every (method, setting) at family-wise alpha 0.001. Each sample is a
    row with its own sample index."""
    model = _vocab8_model()
    prompt = [1, 4, 2]
    tests = len(METHODS) * len(SETTINGS)
    for sampling in SETTINGS:
        expected = _exact_distribution(model, prompt, sampling)
        assert len(expected) > 40  # a distribution with many outcomes, not a near-certain one
        for method in METHODS:
            counts: dict[tuple[int, ...], int] = {}
            for chunk in range(SAMPLES // CHUNK):  # rows are sample indices 0..CHUNK-1; each chunk its own seed
                config = _config(method, replace(sampling, seed=sampling.seed * 1000 + chunk), LENGTH)
                for seq in decode(model, [prompt] * CHUNK, config).sequences:
                    counts[tuple(seq)] = counts.get(tuple(seq), 0) + 1
            p = _chi_square_p(counts, expected, SAMPLES)
            assert p > 0.001 / tests, (method, sampling, p)
