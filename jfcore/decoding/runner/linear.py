"""Linear layers over a few rows on a CPU, computed the fastest of up to three ways (docs/DESIGN.md, "Linear layers
on a CPU").

A decode forward over q positions multiplies q rows by every weight matrix. Batch-1 decoding is memory-bound, so
q = 2..16 should cost about what q = 1 costs: the weights are read once either way. Whether it does depends on the
host's matrix library. On an AMD EPYC host with torch's MKL, `F.linear` over 2 or 3 rows costs 2 or 3 times one row
(a matrix-vector product per row, each reading the whole weight), and one row through SmolLM2-135M's 49152 x 576
output head reads its 113 MB at 17 GB/s; the same products computed with the weight first, weight x inputs^T (the
rows become the library's short dimension), cost 0.3-0.8 of that, and 2.3 ms instead of 6.8 for the head's one row
(as two equal rows). The third way, `rows` (jfcore/decoding/runner/_rows.c, built at install where a C compiler is
at hand), reads each block of weight rows once and multiplies it with every input row while it is in cache: 2-4
times faster than either at 1-32 rows on that host. On another host torch's own way may be the fastest.

So, by measurement, once per machine: `faster_linear(model)` times the ways on the model's largest weight, at 2
and 4 rows; if another way is clearly faster than torch's there, decode forwards over at most `MAX_ROWS` positions
run under `FasterLinear`, a torch function mode (PyTorch's public override mechanism: the model and its classes are
untouched) that, for each weight shape and row count it meets (in `shape_bucket` buckets), times the ways on
that product's operands before computing it, and uses the fastest from then on. Both decisions are kept in this
machine's kernel record (jfcore/decoding/runner/kernel_record.py), so every later process computes the way recorded and
the same command gives the same tokens in every process. Other dtypes and devices, and products that need
gradients, go to torch as they are. The ways compute the same sums in other orders: results agree to float
rounding, which, like any kernel change, can flip a greedy choice only where the top two logits tie to rounding
(the decoders' tests compare tokens with `generate`'s).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from jfcore.decoding.runner.kernel_record import KernelRecord, this_machines_record
from jfcore.decoding.runner.kv_cache import shape_bucket

try:  # after torch, whose OpenMP runtime (libgomp.so.1) the kernel's threads then share
    from jfcore.decoding.runner import _rows
except ImportError:  # built at install where a C compiler is at hand (pyproject.toml)
    _rows = None

# Products of more rows go to torch unchanged, and a forward over more positions runs without the mode: the C kernel
# keeps every input row in cache, which at 128 rows of 1536 floats fills a core's second level, and the mode's
# Python dispatch of every torch call costs a few percent of a wide forward. At 32-128 rows the C kernel still took
# half of torch's time on the host above (weight first gained 0-30% there).
MAX_ROWS = 128
SAMPLES = 3  # timed calls of each way, taking turns, before a weight shape and row count's way is chosen
PROBE_ROWS = (2, 4)  # where `faster_linear` compares the ways before using the mode at all
GAIN = 1.25  # another way must be this much faster than torch's at a probe row count for the mode to be used
# A model whose largest weight is smaller (4 MB in float32) keeps torch's way: its weights stay in cache, where the
# kernels differ little and a timing is mostly noise.
MIN_WEIGHT = 1 << 20

Way = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _torch_way(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _weight_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T as (weight @ x^T)^T: the rows are the product's short side. One row is sent as two equal rows
    (a matrix-vector product is the path being avoided)."""
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    out = torch.mm(weight, (torch.cat([rows, rows]) if single else rows).t())
    out = (out[:, :1] if single else out).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _rows_way(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T in C, each block of weight rows read once for every row of x (jfcore/decoding/runner/_rows.c)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
    bias = None if bias is None else bias.contiguous()  # held: the C code reads it by address
    bias_address = 0 if bias is None else bias.data_ptr()
    n, k = weight.shape
    threads = torch.get_num_threads()
    args = (rows.data_ptr(), weight.data_ptr(), bias_address, out.data_ptr(), rows.shape[0], n, k, threads)
    if torch.autograd._profiler_enabled():  # named in a profile; a record costs microseconds, so only then
        with torch.profiler.record_function("jf::rows_linear"):
            _rows.linear(*args)
    else:
        _rows.linear(*args)
    return out.view(*x.shape[:-1], weight.shape[0])


WAYS: dict[str, Way] = {"torch": _torch_way, "weight_first": _weight_first}
if _rows is not None:
    WAYS["rows"] = _rows_way


@contextlib.contextmanager
def rows_kernel(name: str):
    """Inside the block, `rows` runs the named C kernel (one of `_rows.kernels()`: "wide" where the host has
    AVX-512, "narrow" everywhere) instead of the host's; for tests and benchmarks that compare the two."""
    before = _rows.use(name)
    try:
        yield
    finally:
        _rows.use(before)


def _best_seconds(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ways: tuple[str, ...] | None = None
) -> dict[str, float]:
    """Each way's (of `ways`, default all) shortest of `SAMPLES` timed calls on these operands, the ways taking turns
    after one untimed call each (first-call allocations)."""
    timed = {name: WAYS[name] for name in ways or WAYS}
    seconds: dict[str, float] = {}
    for name, way in timed.items():
        way(x, weight, bias)
        seconds[name] = float("inf")
    for _ in range(SAMPLES):
        for name, way in timed.items():
            start = time.perf_counter()
            way(x, weight, bias)
            seconds[name] = min(seconds[name], time.perf_counter() - start)
    return seconds


def faster_way(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ways: tuple[str, ...] | None = None
) -> str:
    """The way (of `ways`, default all) whose timed calls on these operands were the shortest."""
    seconds = _best_seconds(x, weight, bias, ways)
    return min(seconds, key=seconds.__getitem__)


def _among() -> str:
    # A record's keys name the ways that were timed and the C kernel's version, so a record made before a way
    # existed, or changed, is measured again.
    names = [f"rows{_rows.VERSION}" if name == "rows" and _rows.VERSION > 1 else name for name in WAYS]
    return "" if names == ["torch", "weight_first"] else f" among {'/'.join(names)}"


def product_key(x: torch.Tensor, weight: torch.Tensor) -> str:
    """A product's key in a kernel record: its weight's shape, its row count's bucket, the thread count and (where
    more than the first two exist) the ways timed."""
    rows = shape_bucket(x.numel() // x.shape[-1])
    return f"{weight.shape[0]}x{weight.shape[1]} rows {rows} threads {torch.get_num_threads()}{_among()}"


class FasterLinear(TorchFunctionMode):
    """While active (a context manager), every `F.linear` over at most `MAX_ROWS` float32 CPU rows without
    gradients runs the way chosen for its weight shape, row count (`shape_bucket` of it) and thread count.

    A key met for the first time is decided before its product is computed (`faster_way` on its operands), so
    every product of a key runs one way: by `record`'s choice where one is given (measured once per machine, then
    read), else measured for this mode alone. `choose` (tests) decides instead of measuring. `choices`: the way of
    every key this mode has met."""

    def __init__(
        self,
        record: KernelRecord | None = None,
        choose: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], str] | None = None,
    ):
        super().__init__()
        self.record = record
        self.choose = choose
        self.choices: dict[str, str] = {}

    def over(self, positions: int) -> contextlib.AbstractContextManager:
        """The context for a forward over `positions` (rows x queries): this mode, or none if every product would
        have more than `MAX_ROWS` rows."""
        return self if positions <= MAX_ROWS else contextlib.nullcontext()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if not _plain(x, weight, bias):
            return func(*args, **kwargs)
        key = product_key(x, weight)
        way = self.choices.get(key)
        if way is None:
            way = self.choices[key] = self._decide(key, x, weight, bias)
        return WAYS[way](x, weight, bias)

    def _decide(self, key: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
        if self.choose is not None:
            return self.choose(x, weight, bias)
        if self.record is None:
            return faster_way(x, weight, bias)
        way = self.record.decide(key, lambda: faster_way(x, weight, bias))
        if way not in WAYS:  # a record written by other code: measure here, without it
            way = faster_way(x, weight, bias)
        return str(way)


def _plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Float32 CPU operands of a plain 2D weight, at most `MAX_ROWS` rows, no gradients wanted."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)) or weight.dim() != 2 or x.dim() < 1:
        return False
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.device != x.device:
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.dim() != 1):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return x.shape[-1] > 0 and 0 < x.numel() // x.shape[-1] <= MAX_ROWS


_MODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def faster_linear(model: torch.nn.Module, setting: str = "auto") -> FasterLinear | None:
    """The mode `model`'s eager decode forwards run under for a `DecodeConfig.linear` setting: None for "torch",
    and for "auto" unless the model is float32 on a CPU, its largest linear weight has at least `MIN_WEIGHT`
    elements and another way is at least `GAIN` times faster than torch's on it at a probe row count (measured once per
    machine and weight shape, and recorded with the mode's choices in this machine's kernel record)."""
    if setting == "torch":
        return None
    if model not in _MODES:
        _MODES[model] = None
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2]
        weight = max(weights, key=torch.Tensor.numel, default=None)
        big = weight is not None and weight.numel() >= MIN_WEIGHT
        if big and weight.device.type == "cpu" and weight.dtype == torch.float32:
            record = this_machines_record()
            key = f"gains {weight.shape[0]}x{weight.shape[1]} threads {torch.get_num_threads()}{_among()}"
            if record.decide(key, lambda: _gains(weight)):
                _MODES[model] = FasterLinear(record)
    return _MODES[model]


@torch.inference_mode()
def _gains(weight: torch.Tensor) -> bool:
    generator = torch.Generator().manual_seed(0)
    for rows in PROBE_ROWS:
        seconds = _best_seconds(torch.randn(rows, weight.shape[1], generator=generator), weight, None)
        if seconds.pop("torch") >= GAIN * min(seconds.values()):
            return True
    return False
