"""Linear layers computed the fastest of three ways (jfcore/decoding/runner/linear.py): the same products, the chosen
way used, decoding still exact."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from jfcore.config import ConfigError
from jfcore.decoding import DecodeConfig, decode
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.runner import model_runner
from jfcore.decoding.runner.linear import MAX_ROWS, WAYS, FasterLinear, faster_linear, product_key
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


def test_the_c_kernel_was_built():
    assert "rows" in WAYS, "jfcore/decoding/runner/_rows.c was not built: install a C compiler, pip install -e ."


def _kernels() -> list[str]:
    from jfcore.decoding.runner.linear import _rows

    return list(_rows.kernels()) if _rows is not None else []


@pytest.fixture(params=_kernels())
def kernel(request):
    """Each kernel of `rows` this host runs: the narrow one (8 lanes) everywhere, the wide one (16) with AVX-512."""
    from jfcore.decoding.runner.linear import rows_kernel

    with rows_kernel(request.param):
        yield request.param


@pytest.mark.parametrize("shape", [(1536, 576), (49152, 64), (7, 13), (9, 35), (3, 16), (10, 40), (320, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 32])
def test_the_c_kernel_sums_like_float64_and_each_row_alone(shape, rows, kernel):
    """Against the float64 product: within float32 rounding of a K-term sum, like torch's own kernel, for weight row
    counts that are not a multiple of its blocks (4 wide, 3 narrow), inner sizes that are not a multiple of its lanes
    (16, 8), and input row counts that are not a multiple of its 4. Each row's outputs are bitwise the same as that
    row's alone and whatever the thread count: they do not depend on what else the forward carries."""
    outputs, features = shape
    x, weight, bias = operands((rows,), features=features, outputs=outputs, seed=rows)
    exact = torch.addmm(bias.double(), x.double(), weight.double().t())
    got = WAYS["rows"](x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, outputs) and got.is_contiguous()
    bound = 4 * features * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().t() + 1)
    assert ((got.double() - exact).abs() <= bound).all()
    for row in {0, rows - 1}:
        assert torch.equal(WAYS["rows"](x[row : row + 1], weight, bias), got[row : row + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(WAYS["rows"](x, weight, bias), got)
    finally:
        torch.set_num_threads(threads)


def test_the_host_runs_the_wide_kernel_only_where_it_has_avx512():
    from jfcore.decoding.runner.linear import _rows

    with open("/proc/cpuinfo") as info:
        flags = next((line.split() for line in info if line.startswith("flags")), [])
    wide = all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"))
    assert _rows.kernels() == (("wide", "narrow") if wide else ("narrow",))
    if not wide:
        with pytest.raises(ValueError, match="needs AVX-512"):
            _rows.use("wide")


def test_the_c_kernel_shares_torchs_openmp_runtime():
    """Its threads are torch's: one libgomp is mapped (two runtimes would each keep a pool spinning on the same
    cores)."""
    x, weight, bias = operands((4,), features=64, outputs=64)
    WAYS["rows"](x, weight, bias)
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


def test_a_record_timed_with_an_older_c_kernel_is_measured_again():
    """Kernel records keep each product's fastest way; the C kernel's speed changed with its version (2: the next
    block prefetched; 3: a narrow kernel without AVX-512), so its keys name the version, and choices timed against
    version 1 (keys ending "among torch/weight_first/rows") are not reused."""
    from jfcore.decoding.runner.linear import _rows

    x, weight, _ = operands((4,))
    assert _rows.VERSION >= 3
    assert product_key(x, weight).endswith(f" among torch/weight_first/rows{_rows.VERSION}")


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
        # The ways round differently here, so the output shows which one ran.
        outputs = [w(x, layer.weight, layer.bias) for w in WAYS.values()]
        assert not any(torch.equal(a, b) for i, a in enumerate(outputs) for b in outputs[i + 1 :])
        with mode:
            first, again = layer(x), layer(x)
            layer(x[:, :2])
    assert torch.equal(first, WAYS[way](x, layer.weight, layer.bias)) and torch.equal(again, first)
    assert calls == [((1, 3, 576), (1536, 576)), ((1, 2, 576), (1536, 576))]  # 3 rows measured once; 2 rows apart
    assert set(mode.choices.values()) == {way}


def test_each_shape_and_row_bucket_is_decided_before_its_first_product():
    """Measured on the key's first operands before the product is computed, so every product of a key, the first
    included, runs the one way kept; another row bucket is decided apart."""
    layer = torch.nn.Linear(96, 320)
    mode = FasterLinear()
    with torch.inference_mode():
        x = torch.randn(5, 96)
        with mode:
            first = layer(x)
        key = product_key(x, layer.weight)
        assert list(mode.choices) == [key] and key.startswith("320x96 rows 6 threads")
        assert torch.equal(first, WAYS[mode.choices[key]](x, layer.weight, layer.bias))
        with mode:
            layer(torch.randn(6, 96))  # the same bucket: decided already
            layer(torch.randn(7, 96))  # another bucket
    assert len(mode.choices) == 2


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
    assert mode.choices == {}  # the mode saw nothing
    with mode.over(MAX_ROWS):
        F.linear(x, weight, bias)
    assert len(mode.choices) == 1


def test_small_models_and_torch_setting_run_no_mode():
    small = tiny_model(next(iter(ARCHITECTURES)))  # its weights fit in cache: timings there are noise
    assert faster_linear(small, "auto") is None
    assert faster_linear(small, "torch") is None
    with pytest.raises(ConfigError, match="linear must be one of 'auto', 'torch'"):
        DecodeConfig(linear="fast")


@pytest.mark.parametrize("way", [name for name in WAYS if name != "torch"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("method", ["ar", "jacobi", "multiblock"])
def test_decoding_through_another_way_matches_generate(arch, method, way):
    """Every linear product of the forwards the mode runs (those over at most MAX_ROWS positions, a prefill's
    included) computed weight first (one row as two) or by the C kernel: the tokens are still `generate`'s."""
    model = tiny_model(arch)
    prompts = [[7, 3, 9, 1, 4, 4, 2], [5], [11, 12, 13], [60, 2, 2, 8, 9, 1, 33, 71, 5, 5, 19]]
    expected = [greedy_reference(model, p, 40) for p in prompts]
    config = DecodeConfig(method=method, block_size=5, max_new_tokens=40)
    chosen = []
    decoder = Decoder(model, config, [], 0)
    decoder.runner.linear = FasterLinear(choose=lambda x, weight, bias: chosen.append(x.numel() // x.shape[-1]) or way)
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

    monkeypatch.setattr(model_runner, "faster_linear", probe)
    model = tiny_model(next(iter(ARCHITECTURES)))
    decoder = Decoder(model, DecodeConfig(method="ar", max_new_tokens=4), [], 0)
    assert probed_on == []  # building the decoder measures nothing
    worker = threading.Thread(target=decoder.decode, args=([[5, 6, 7]],))
    worker.start()
    worker.join()
    decoder.decode([[5, 6, 7]])
    assert probed_on == [worker]  # once, on the decoding thread


def test_with_the_mode_on_every_method_is_its_own_ar_and_every_process_computes_the_recorded_way(tmp_path, monkeypatch):
    """The mode on for a tiny model (its size threshold and gain lowered): the choices are measured once and kept in
    this machine's kernel record; AR, Jacobi and multiblock under it give the project's own AR tokens; a second
    process reads the record, measures nothing and gives the same tokens."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from jfcore.decoding.runner import linear

    monkeypatch.setenv("JF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear, "MIN_WEIGHT", 0)
    monkeypatch.setattr(linear, "GAIN", 0.0)
    model = tiny_model("llama")
    prompts = [[7, 3, 9, 1, 4, 4, 2], [5], [11, 12, 13]]
    ar = decode(model, prompts, DecodeConfig(method="ar", max_new_tokens=30), eos_token_id=[], pad_token_id=0)
    mode = faster_linear(model)
    assert mode is not None and mode.record is not None and mode.record.path.parent == tmp_path / "kernels"
    for method in ("jacobi", "multiblock"):
        config = DecodeConfig(method=method, block_size=5, max_new_tokens=30)
        assert decode(model, prompts, config, eos_token_id=[], pad_token_id=0).sequences == ar.sequences, method
    recorded = json.loads(mode.record.path.read_text())["choices"]
    assert any(k.startswith("gains ") for k in recorded) and set(mode.choices.items()) <= set(recorded.items())
    assert len({k.split(" rows ")[1] for k in mode.choices}) >= 3  # AR's products and wider ones went through it
    before = mode.record.path.read_bytes()

    script = f"""
import json, torch
from jfcore.decoding import DecodeConfig, decode
from jfcore.decoding.runner import linear
from tests.support.tiny_models import tiny_model
linear.MIN_WEIGHT = 0
torch.set_num_threads({torch.get_num_threads()})
model = tiny_model("llama")
config = DecodeConfig(method="ar", max_new_tokens=30)
out = decode(model, {prompts!r}, config, eos_token_id=[], pad_token_id=0).sequences
print(json.dumps([out, linear.faster_linear(model).choices]))
"""
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
        env={**__import__("os").environ, "JF_CACHE_DIR": str(tmp_path)},
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    tokens, choices = json.loads(run.stdout.splitlines()[-1])
    assert tokens == ar.sequences
    assert choices.items() <= recorded.items() and mode.record.path.read_bytes() == before  # read, not measured
