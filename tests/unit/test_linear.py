"""Linear layers computed the faster of two ways (jfcore/decoding/linear.py): the same products, the chosen way
used, decoding still exact."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from jfcore.config import ConfigError
from jfcore.decoding import DecodeConfig, decode, jacobi
from jfcore.decoding.jacobi import JacobiDecoder
from jfcore.decoding.linear import MAX_ROWS, SAMPLES, WAYS, FasterLinear, faster_linear
from tests.support.tiny_models import ARCHITECTURES, greedy_reference, tiny_model


def operands(rows: tuple[int, ...], features=96, outputs=320, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, features, generator=generator)
    weight = torch.randn(outputs, features, generator=generator)
    return x, weight, torch.randn(outputs, generator=generator) if bias else None


@pytest.mark.parametrize("rows", [(1,), (2,), (3,), (17,), (1, 1), (2, 5), (3, 1, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_both_ways_compute_torchs_product(rows, bias):
    x, weight, b = operands(rows, bias=bias)
    expected = F.linear(x, weight, b)
    for name, way in WAYS.items():
        got = way(x, weight, b)
        assert got.shape == expected.shape and got.is_contiguous(), name
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("way", list(WAYS))
def test_the_mode_runs_the_chosen_way_and_chooses_once_per_shape(way):
    calls = []

    def choose(x, weight, bias):
        calls.append((tuple(x.shape), tuple(weight.shape)))
        return way

    layer = torch.nn.Linear(576, 1536)
    mode = FasterLinear(choose=choose)
    x = torch.randn(1, 3, 576)
    with torch.inference_mode():
        # The two ways round differently here, so the output shows which one ran.
        assert not torch.equal(
            WAYS["torch"](x, layer.weight, layer.bias), WAYS["weight_first"](x, layer.weight, layer.bias)
        )
        with mode:
            first, again = layer(x), layer(x)
            layer(x[:, :2])
    assert torch.equal(first, WAYS[way](x, layer.weight, layer.bias)) and torch.equal(again, first)
    assert calls == [((1, 3, 576), (1536, 576)), ((1, 2, 576), (1536, 576))]  # 3 rows measured once; 2 rows apart
    assert set(mode.choices.values()) == {way}


def test_each_shape_and_row_bucket_is_measured_on_its_own_calls_then_decided():
    layer = torch.nn.Linear(96, 320)
    mode = FasterLinear()
    key = ((320, 96), 6, torch.get_num_threads())
    with torch.inference_mode():
        for i in range(2 * SAMPLES):
            x = torch.randn(5 + i % 2, 96)  # 5 and 6 rows: one bucket
            with mode:
                out = layer(x)
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            assert (key in mode.choices) == (i == 2 * SAMPLES - 1)  # decided once each way ran SAMPLES calls
        assert mode.timings == {} and mode.choices[key] in WAYS
        with mode:
            layer(torch.randn(7, 96))  # another bucket: measured apart
    assert len(mode.timings) == 1 and len(mode.choices) == 1


@pytest.mark.parametrize(
    "case",
    ["grad wanted", "float64", "too many rows", "not linear"],
)
def test_the_mode_leaves_other_work_to_torch(case):
    mode = FasterLinear(choose=lambda *operands: "weight_first")
    x, weight, bias = operands((3,))
    if case == "float64":
        x, weight, bias = x.double(), weight.double(), bias.double()
    if case == "too many rows":
        x = torch.randn(MAX_ROWS + 1, x.shape[-1])
    if case == "grad wanted":
        weight.requires_grad_(True)
    with mode:
        out = torch.matmul(x, weight.t()) if case == "not linear" else F.linear(x, weight, bias)
    expected = torch.matmul(x, weight.t()) if case == "not linear" else F.linear(x, weight, bias)
    assert torch.equal(out, expected) and mode.choices == {}
    if case == "grad wanted":
        out.sum().backward()  # torch's own op, so gradients flow as usual
        assert weight.grad is not None


def test_forwards_over_more_positions_run_without_the_mode():
    mode = FasterLinear()
    x, weight, bias = operands((2,))
    with mode.over(MAX_ROWS + 1):
        F.linear(x, weight, bias)
    assert mode.timings == {}  # the mode saw nothing
    with mode.over(MAX_ROWS):
        F.linear(x, weight, bias)
    assert len(mode.timings) == 1


def test_small_models_and_torch_setting_run_no_mode():
    small = tiny_model(next(iter(ARCHITECTURES)))  # its weights fit in cache: timings there are noise
    assert faster_linear(small, "auto") is None
    assert faster_linear(small, "torch") is None
    with pytest.raises(ConfigError, match="linear must be one of 'auto', 'torch'"):
        DecodeConfig(linear="fast")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("method", ["ar", "jacobi", "multiblock"])
def test_decoding_through_the_weight_first_way_matches_generate(arch, method):
    """Every linear product of the forwards the mode runs (those over at most MAX_ROWS positions, a prefill's
    included) computed weight first, one row as two: the tokens are still `generate`'s."""
    model = tiny_model(arch)
    prompts = [[7, 3, 9, 1, 4, 4, 2], [5], [11, 12, 13], [60, 2, 2, 8, 9, 1, 33, 71, 5, 5, 19]]
    expected = [greedy_reference(model, p, 40) for p in prompts]
    config = DecodeConfig(method=method, block_size=5, max_new_tokens=40)
    chosen = []
    decoder = JacobiDecoder(model, config, [], 0)
    decoder.linear = FasterLinear(
        choose=lambda x, weight, bias: chosen.append(x.numel() // x.shape[-1]) or "weight_first"
    )
    assert decoder.decode(prompts).sequences == expected
    assert decoder.decode(prompts[:1]).sequences == expected[:1]  # one row: AR's products are one row each
    assert 1 in chosen and max(chosen) > 1  # one-row products and wider ones went through it
    assert decode(model, prompts, config, eos_token_id=[], pad_token_id=0).sequences == expected


def test_the_linear_probe_runs_on_the_thread_that_decodes(monkeypatch):
    """jf-serve builds its decoder on one thread and decodes on another: the probe's products belong to the
    second (torch work on the first slowed every later forward of the second)."""
    probed_on = []

    def probe(model, setting):  # no mode: forwards run torch's kernels
        probed_on.append(threading.current_thread())

    monkeypatch.setattr(jacobi, "faster_linear", probe)
    model = tiny_model(next(iter(ARCHITECTURES)))
    decoder = JacobiDecoder(model, DecodeConfig(method="ar", max_new_tokens=4), [], 0)
    assert probed_on == []  # building the decoder measures nothing
    worker = threading.Thread(target=decoder.decode, args=([[5, 6, 7]],))
    worker.start()
    worker.join()
    decoder.decode([[5, 6, 7]])
    assert probed_on == [worker]  # once, on the decoding thread
